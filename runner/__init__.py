"""lightfleet's runner. Its folders are its layers, bottom to top: a module imports only from its
own folder and the layers below it (tests/test_layers.py holds the code to LAYERS).

    core/        the vocabulary: errors, world (processes and their layout), contribution (what a
                 strategy adds), plan (the contributions combined), clock, paths. Pure: no torch, no Hydra.
    strategies/  one module per strategy: its knobs (their only defaults and ranges), its checks, its
                 contribution to the plan, its answers for auto. Pure; the package is the registry.
    config/      the run's schema, the allowed-combination table, Hydra composition (Hydra's private
                 API in hydra_api alone), the checks of a composed config and the arguments of its
                 `_target_` nodes, the built-in models' and data's counts, sizes and paths (values).
    records/     the run directory: its files, how a job ended, and `lightfleet report` over them.
    fleet/       Fleet's strategy files: the prototxt message, import and export.
    models, data the built-in LightningModules and DataModules (beside plugins/, the Lightning
                 components that carry out each strategy).
    rank/        inside each rank: build (carries out the plan), train, and the runner's own callbacks
                 (measure, preemption, resume, progress); rehearse, a rank of a fake world built by
                 the same build and measured (`lightfleet rehearse`).
    command/     the command process: the preflight (every check, in order), the plans, the CLI, the
                 job, the launch of the ranks, auto's trials; `python -m runner` and `python -m runner.train
                 RUN_DIR` (a fresh rank's entry point) stand at this level.
"""
# Bottom to top; names directly under runner/ (a folder or a module), and `plugins`, the sibling package.
LAYERS = (
    ("core",),
    ("strategies",),
    ("config",),
    ("records",),
    ("fleet",),
    ("models", "data", "plugins"),
    ("rank",),
    ("command", "train", "__main__"),
)
# What imports neither torch, Lightning, Hydra nor OmegaConf: a refused command never loads them.
PURE = ("core", "strategies", "config.schema", "config.collective", "config.fast_path", "config.compat",
        "config.knobs", "config.values",
        "config.rehearse")
