"""Expert parallelism: :mod:`~ds_core.parallel.expert.moe` holds the expert-parameter marker,
its process groups and a small MoE layer. AutoEP (expert parallelism applied to a model's
existing MoE blocks) is :mod:`ds_core.zero.autoep`: it restores ``zero.Init``-partitioned
modules and validates the engine's config section, so it lives beside them."""
