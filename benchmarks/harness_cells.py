"""Ours against stock through the check harness's real engines, prefill TP 1
-> decode TP 1 (equal ratios, so both read right): the cells the ``harness``
and ``link`` benchmarks run, and their results per layout."""

from __future__ import annotations

#: the connectors compared, in the order their cells run
CONNECTORS = {"ours": "NixlHMAConnector", "stock": "NixlConnector"}


def one_to_one_cells(layouts, model_dirs: dict[str, str], scenarios, **cell_options) -> list:
    """Per (layout, --block-size of both engines) of ``layouts``, one cell per
    connector; ``cell_options`` go to every ``Cell`` (e.g. the hosts)."""
    from vllm_nixl_hma.harness import coordinator

    return [
        coordinator.Cell(
            layout,
            model_dirs[layout],
            p_tp=1,
            d_tp=1,
            connector=connector,
            scenarios=scenarios,
            num_gpu_blocks=4096,
            prefill_block_size=block_size,
            decode_block_size=block_size,
            **cell_options,
        )
        for layout, block_size in layouts
        for connector in CONNECTORS.values()
    ]


def measured_by_layout(results: list, layouts, per_cell: int, where: str = "") -> dict:
    """``{layout: {connector name: results}}`` from ``run_cells``' results of
    ``one_to_one_cells``, each cell's first batch (warm-up and handshake)
    left out; raises on any batch that did not deliver every slot right."""
    measured: dict[str, dict[str, list]] = {}
    for index, (layout, _) in enumerate(layouts):
        measured[layout] = {}
        for offset, name in enumerate(CONNECTORS):
            start = (len(CONNECTORS) * index + offset) * per_cell
            cell_results = results[start : start + per_cell]
            for result in cell_results:
                if not result.ok:
                    raise RuntimeError(
                        f"{name} {layout}{where} {result.name}: {result.error or result.examples}"
                    )
            measured[layout][name] = cell_results[1:]
    return measured
