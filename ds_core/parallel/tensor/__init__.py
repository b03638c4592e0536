"""AutoTP: tensor parallelism for training, applied to an unmodified model.

:func:`apply_autotp` (called by :func:`ds_core.initialize` when the config has
``tensor_parallel.autotp_size`` > 1) and :func:`tp_model_init` (DeepSpeed's function form)
replace ``nn.Linear`` modules by tensor-parallel ones over the TP group of
:func:`ds_core.comm.device_mesh` (TP ranks adjacent: ``tp_rank = rank % tp_size``):

- **column-parallel** (:class:`LinearColumnParallel`; q/k/v, gate/up projections): output
  features and bias split; the input passes through :class:`CopyToTP` (identity forward,
  all-reduce of its gradient backward) so each rank's input gradient becomes the full one;
  the output stays sharded, or is all-gathered (:class:`GatherFromTP`) when its spec says
  ``gather_output`` (an LM head whose logits the loss reads whole). A fused weight
  (``[q; k; v]``, ``[gate; up]``) splits each sub-parameter — equal ones, or grouped-query
  attention's ``(q, kv, kv)`` — so every rank keeps matching slices of each.
- **row-parallel** (:class:`LinearRowParallel`; o/down projections): input features split;
  the partial outputs are summed by :class:`ReduceFromTP` (all-reduce forward, identity
  backward) and the bias, kept whole and replicated, is added once after the sum.

- **vocab-parallel embedding** (:class:`VocabParallelEmbedding`, only when a spec names an
  ``nn.Embedding`` with ``row``): the vocabulary rows split; ids outside this rank's rows look
  up zeros and :class:`ReduceFromTP` sums the one rank's row. An embedding whose weight is tied
  to an LM head (one Parameter) is split only together with that head (``column``, the same
  rows), into one shared shard; a tie split one way in one module and another way (or not at
  all) in the other is refused naming both. An LM head split without ``gather_output`` keeps
  its logits sharded; :func:`vocab_parallel_cross_entropy` computes the loss from them. A vocabulary not divisible by the TP size is an
  error naming the module.

The collectives go through the accelerator facade's ``all_reduce`` / ``all_gather`` (the comm
hooks).

**Which modules.** With no partition config, or with ``use_default_specs`` true for modules no
spec matches, the name heuristics apply: inside one parent module, children named like a
column projection (``q_proj k_proj v_proj query key value gate_proj up_proj fc1 fc c_fc fc_in
w1 w3 dense_h_to_4h``; fused ``qkv qkv_proj c_attn Wqkv`` as 3 sub-parameters — of sizes
``(h·d, kv·d, kv·d)`` when the parent has fewer key/value heads ``kv`` than heads ``h`` —,
``gate_up_proj`` as 2 equal ones) are split column-wise and children named like an output projection (``o_proj
down_proj out_proj c_proj proj fc2 fc_out w2 dense_4h_to_h``) row-wise — but only when the
parent has both kinds, so a lone ``proj`` or ``fc`` elsewhere stays replicated.
``lm_head_patterns`` names are never split; embeddings, norms and every other parameter stay
replicated. A partition config's ``layer_specs`` override the heuristics: each entry's
``patterns`` are **regular expressions** matched with ``re.match`` (anchored at the start, as
DeepSpeed does) against ``<full module path>.weight``, e.g. ``model\\.layers\\.0\\.mlp\\.up_proj
\\.weight`` or ``.*\\.self_attn\\.[qkv]_proj\\.weight$``; the first matching entry decides
(``column``, ``row``, or ``skip`` / ``replicate``), with ``shape`` ``[k, -1]`` or ``[[n1, n2,
...], -1]`` for a fused weight's sub-parameters along dim 0 and ``gather_output`` for a column
split. A pattern matching no module, a split of a module that is neither an ``nn.Linear`` nor
an ``nn.Embedding``, or a dimension (each sub-parameter's) not divisible by the TP size is a
:class:`~ds_core.ConfigError` naming it.

**Attention heads.** A column split of q/k/v must keep whole heads on each rank. The parent of
split attention projections (a module with a column-split ``q_proj``/``k_proj``/``v_proj``/
``query``/``key``/``value`` or fused ``qkv`` child) has each of its integer attributes
``num_heads n_head n_heads num_attention_heads num_key_value_heads num_kv_heads n_kv_heads
n_kv_head`` divided by the TP size (an error when one is not divisible), so an attention that
reshapes with its head count computes with its local heads. An attention that reshapes with
``-1`` and a head dimension needs nothing; one that uses a width attribute (``hidden_size``,
``embed_dim``) in its reshape must derive it from the tensor instead (``view(B, T, -1)``).

**With ZeRO.** Split parameters carry :data:`TP_ATTR`; the engine partitions every parameter
over the DP group only, averages gradients over the DP size, and counts TP shards once each in
the gradient norm (summed over the whole mesh) and replicated parameters once (on TP rank 0),
since their gradients are equal on every TP rank: every rank of a TP group sees the same
batch and the same full activations. The other TP ranks still add ``0 × ‖g‖²`` of their
replicas, so a non-finite gradient on any one rank makes the norm non-finite on all of them
and fp16/bf16 overflow skips (and the clip coefficient) agree across the mesh.

**Checkpoints.** ``save_checkpoint(..., universal=True)`` stores each split parameter once,
gathered to its full name and shape (:data:`TP_ATTR` and :data:`TP_FUSED_ATTR` say how), and
a load at any TP size cuts it again; see [Note: TP in checkpoints] in
:mod:`ds_core.checkpoint._tp`. A native-format save of a TP engine is refused.
"""

from ds_core.parallel.tensor.layers import (
    TP_ATTR,
    TP_FUSED_ATTR,
    CopyToTP,
    GatherFromTP,
    LinearColumnParallel,
    LinearRowParallel,
    ReduceFromTP,
    VocabParallelEmbedding,
    is_tp_sharded,
    join_rows,
    slice_rows,
    vocab_parallel_cross_entropy,
)
from ds_core.parallel.tensor.plan import (
    apply_autotp,
    model_tp_size,
    plan_autotp,
    replaced_parameters,
    tp_model_init,
)

__all__ = [
    "TP_ATTR",
    "TP_FUSED_ATTR",
    "CopyToTP",
    "GatherFromTP",
    "LinearColumnParallel",
    "LinearRowParallel",
    "ReduceFromTP",
    "VocabParallelEmbedding",
    "apply_autotp",
    "is_tp_sharded",
    "join_rows",
    "model_tp_size",
    "plan_autotp",
    "replaced_parameters",
    "slice_rows",
    "tp_model_init",
    "vocab_parallel_cross_entropy",
]
