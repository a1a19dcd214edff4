"""`specverify bench`: no speculation, fixed K and adaptive verification side by side on real prompts.

`datasets` loads the prompt sets, `runner` runs the modes over a concurrency sweep on shared models,
`report` prints the table and writes results.json and the plots, `cli` wires it to the command line.
"""

from specverify.bench.datasets import DATASETS, DatasetError, load_prompts

__all__ = [
    "DATASETS",
    "MODES",
    "BenchConfig",
    "BenchRun",
    "BenchRunner",
    "DatasetError",
    "RunResult",
    "load_prompts",
]


def __getattr__(name: str):
    # The runner pulls in torch and the engine; load it on first use so `specverify --help` stays fast.
    if name in ("MODES", "BenchConfig", "BenchRun", "BenchRunner", "RunResult"):
        from specverify.bench import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'specverify.bench' has no attribute {name!r}")
