"""The schemas of the flashhopper::fwd and flashhopper::bwd ops: their one home. ops.py defines the
Python ops from them; the C++ ops (src/torch/ops.cpp) register them from src/torch/op_schemas.inc,
which scripts/generate_kernels.py writes from this file (CI checks it is current). This module
imports nothing, so the generator reads it without torch.

The options added after `deterministic` come last so that positional calls written for the first
six arguments keep their meaning."""

FWD_SCHEMA = ("fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, bool causal=False, "
              "bool deterministic=False, SymInt window_left=-1, SymInt window_right=-1, float softcap=0., "
              "SymInt attention_chunk=0, Tensor? learnable_sink=None, Tensor? cu_seqlens_q=None, "
              "Tensor? cu_seqlens_k=None, SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, "
              "Tensor? seqused_q=None, Tensor? seqused_k=None, SymInt num_splits=1, SymInt sm_margin=0, "
              "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None) -> (Tensor, Tensor)")
BWD_SCHEMA = ("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float? softmax_scale=None, "
              "bool causal=False, bool deterministic=False, SymInt window_left=-1, SymInt window_right=-1, "
              "float softcap=0., SymInt attention_chunk=0, Tensor? learnable_sink=None, "
              "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt? max_seqlen_q=None, "
              "SymInt? max_seqlen_k=None, Tensor? seqused_q=None, Tensor? seqused_k=None, SymInt sm_margin=0) "
              "-> (Tensor, Tensor, Tensor, Tensor)")
