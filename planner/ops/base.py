"""Types shared by every cost formula: the op spec, the per-micro-batch cost, the context.

Notation used in every formula docstring: B micro-batch, T seq_len, D d_model, F d_ff,
N heads, K kv heads, H head dim, V vocab. FLOPs count 2 per multiply-add and the full T x T
attention, backward = 2 x forward for matmuls, as ``torch.utils.flop_counter.FlopCounterMode``.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from hardware.collectives import Collective
from hardware.dtypes import DType
from hardware.kernels import AttentionKernel, AttentionShape, GemmShape
from planner.model.families.moe.config import MoeConfig
from planner.precision import PrecisionSpec


class OpKind(StrEnum):
    EMBEDDING = "embedding"
    POS_EMBEDDING = "pos_embedding"
    ROPE_TABLES = "rope_tables"
    CAUSAL_MASK = "causal_mask"
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"
    LINEAR = "linear"
    ROTARY = "rotary"
    ATTENTION_FLASH = "attention_flash"
    ATTENTION_EAGER = "attention_eager"
    ATTENTION_RING = "attention_ring"  # SDPA under context parallelism: torch's ring attention
    RESIDUAL_ADD = "residual_add"
    GELU = "gelu"
    SILU = "silu"
    GLU_MUL = "glu_mul"
    DROPOUT = "dropout"
    CAST = "cast"
    CROSS_ENTROPY = "cross_entropy"
    # collectives of a parallel group, named as Megatron-LM's mappings (core/tensor_parallel/mappings.py)
    COPY_TO_REGION = "copy_to_region"  # forward: the same tensor (a view); backward: all-reduce
    REDUCE_FROM_REGION = "reduce_from_region"  # forward: all-reduce of partial sums; backward: the same
    GATHER_FROM_SEQUENCE = "gather_from_sequence"  # forward: all-gather along the sequence; backward: reduce-scatter
    REDUCE_SCATTER_TO_SEQUENCE = "reduce_scatter_to_sequence"  # forward: reduce-scatter; backward: all-gather
    SCATTER_TO_SEQUENCE = "scatter_to_sequence"  # forward: keep this rank's chunk (a copy); backward: all-gather
    # mixture of experts (planner.ops.moe)
    MOE_SLOTS = "moe_slots"  # which token each expert row holds (int64, no gradient)
    MOE_DISPATCH = "moe_dispatch"  # index_select the tokens into the expert rows
    GROUPED_LINEAR = "grouped_linear"  # E linears over E equal groups of rows (bmm)
    MOE_ROUTE = "moe_route"  # fp32 softmax of the router logits, the chosen weights in row order
    MOE_COMBINE = "moe_combine"  # each row times its weight, index_add into its token
    CLAMPED_SWIGLU = "clamped_swiglu"  # gpt-oss's expert activation over interleaved (gate, up) columns
    GATE_SCALE = "gate_scale"  # x * sigmoid(g) with g one value per token (Qwen2-MoE's shared expert gate)
    MOE_SCALE = "moe_scale"  # each expert row times its routing weight, before the experts (Llama 4)
    MOE_GATHER = "moe_gather"  # the experts' rows index_added into their tokens, unweighted (Llama 4)
    # Llama 4's attention (planner.ops.llama4)
    QK_L2_NORM = "qk_l2_norm"  # weightless fp32 RMS norm of q and k per head, after the rotary
    ATTN_TEMPERATURE = "attn_temperature"  # q times an fp32 per-position scale on the no-RoPE blocks
    # expert parallelism (planner.parallel.expert)
    ALL_TO_ALL = "all_to_all"  # expert rows exchanged with the expert-parallel group
    PERMUTE_ROWS = "permute_rows"  # received rows regrouped by expert (or back by source rank): a copy
    # pipeline parallelism (planner.ops.pipeline)
    STAGE_INPUT = "stage_input"  # the activation a pipeline stage receives from the one before it
    # multi-head latent attention (planner.ops.mla)
    SLICE = "slice"  # a view of some columns of a projection's output (no copy)
    MLA_CONCAT = "mla_concat"  # q = cat(q_nope, q_rope), k = cat(k_nope, k_rope expanded over heads)
    HEAD_MERGE_COPY = "head_merge_copy"  # (B, N, T, H) -> (B, T, N H) of a head-major tensor: a copy
    # fine-tuning (planner.finetune, planner.ops.scale)
    SCALE = "scale"  # x * a Python float (a LoRA adapter's output times alpha / rank)
    ADAPTER_CAST = "adapter_cast"  # x.to(the adapters' dtype) (peft's _cast_input_dtype); none when equal
    # Gemma 2 (planner.ops.gemma)
    LOGIT_SOFTCAP = "logit_softcap"  # c * tanh(z / c) of the logits before the loss (final_logit_softcapping)


class OpVariant(StrEnum):
    """How an implementation runs an op the reference model also runs (``planner.graph.implementations``);
    a variant has its own formula (``planner.ops.registry.register_variant``)."""

    REFERENCE = "reference"  # as validate/reference_model.py runs it
    NORM_FP32 = "norm_fp32"  # transformers' LlamaRMSNorm: upcast to fp32, cast back before the weight
    NORM_GEMMA = "norm_gemma"  # transformers' Gemma2/Gemma3 RMSNorm: in fp32, times (1 + w) in fp32, cast back
    NORM_FUSED = "norm_fused"  # F.rms_norm as CUDA runs it (_fused_rms_norm): saves input and per-row rstd
    GELU_NEW = "gelu_new"  # transformers' NewGELUActivation: the tanh formula written out
    GELU_FAST = "gelu_fast"  # transformers' FastGELUActivation: written out
    SHARED_CAST = "shared_cast"  # k/v of a fused q/k/v projection: autocast's input copy is q's
    SPLIT_COPIES = "split_copies"  # the last of torchtitan's fused wqkv outputs: split into contiguous copies
    COMPLEX_ROTARY = "complex_rotary"  # torchtitan's ComplexRoPE: fp32 complex product, cast back
    SHIFTED_LABELS = "shifted_labels"  # transformers' ForCausalLMLoss: labels padded and shifted, then saved
    SCALED_TABLES = "scaled_tables"  # transformers' rotary cos/sin, times attention_scaling
    EAGER_FP32_SOFTMAX = "eager_fp32_softmax"  # transformers' eager attention: softmax(dtype=float32), mask added
    EAGER_MASK_ADDED = "eager_mask_added"  # transformers' GPT-2 eager attention: the float mask added
    FLOAT_MASK = "float_mask"  # transformers' eager mask: (B, 1, T, T) of 0 and -inf in the stream's dtype
    ROPE_BUFFERS = "rope_buffers"  # torchtitan: every layer's RoPE module holds a (T, H/2) complex64 buffer
    # losses that take the final norm's output and own the LM head: the logits never exist whole
    CHUNKED_LOSS = "chunked_loss"  # torchtitan's ChunkedLossWrapper: lm_head + cross-entropy + backward per chunk
    FUSED_LINEAR_LOSS = "fused_linear_loss"  # Liger's fused linear cross-entropy: no logits kept
    # a tensor-parallel mixture-of-experts block (planner.parallel.tensor_moe) runs on local views
    LOCAL_WEIGHT = "local_weight"  # weight used as its DTensor's to_local() view: autocast does not cache its cast
    REPLICATED_WEIGHT = "replicated_weight"  # the same, whole on every rank; its partial gradient all-reduced


HIDDEN_STATE_LOSSES = frozenset({OpVariant.CHUNKED_LOSS, OpVariant.FUSED_LINEAR_LOSS})


class TensorInfo(BaseModel):
    """An activation tensor: element count, dtype, whether autograd tracks it."""

    model_config = ConfigDict(frozen=True)
    numel: int
    dtype: DType
    requires_grad: bool = True

    @property
    def n_bytes(self) -> int:
        return self.numel * self.dtype.n_bytes


class ParamTensor(BaseModel):
    """One parameter tensor an op uses; ``name`` is its state-dict key (shared when tied).

    ``rows`` is its first dimension (``out_features`` of a linear weight, ``V`` of an embedding):
    FSDP2 shards every parameter along it.
    """

    model_config = ConfigDict(frozen=True)
    name: str
    numel: int
    rows: int = 0  # 0: a 1-D tensor whose rows are its elements
    grad_numel: int = 0  # 0: the gradient has the parameter's shape (a vocabulary-parallel embedding's is whole)
    shard_dim: int = 0  # the dim FSDP2 shards (``rows`` is its size); not 0: copies at all-gather and reduce-scatter
    expert_parallel: bool = False  # this rank's experts under expert parallelism: FSDP2 shards them over dp_shard / ep
    frozen: bool = False  # requires_grad False (a fine-tuning plan's base weights): no gradient, no optimizer state

    @property
    def dim0(self) -> int:
        return self.rows or self.numel

    @property
    def grad_elements(self) -> int:
        """Elements of its ``.grad`` (0: frozen, autograd makes none)."""
        return 0 if self.frozen else self.grad_numel or self.numel

    @property
    def state_elements(self) -> int:
        """Elements of each optimizer state tensor it has (0: frozen, the optimizer never sees a gradient)."""
        return 0 if self.frozen else self.numel


class LayerSpec(BaseModel):
    """What an op is: its kind, its graph/module name, its block, and the sizes it needs."""

    model_config = ConfigDict(frozen=True)
    name: str
    kind: OpKind
    block: int | None = None
    in_features: int = 0
    out_features: int = 0
    bias: bool = False
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0  # attention: the value heads' size where it differs from head_dim (MLA); 0: head_dim
    dropout: float = 0.0
    attention_kernel: AttentionKernel | None = None  # the fused kernel named by the model; None: the device's
    window: int = 0  # sliding-window attention (and its mask): keys each query sees; 0: full causal
    sinks: bool = False  # attention sinks: a learned logit per head beside each row of scores (gpt-oss)
    softcap: bool = False  # eager attention: scores soft-capped, c * tanh(s / c), before the mask (Gemma 2)
    group_size: int = 1  # collectives and sharded ops: ranks of the parallel group
    ranks_per_node: int = 1  # of those, how many share a node (NVLink) with this rank
    params: tuple[ParamTensor, ...] = ()
    owns_params: bool = True  # False when the params belong to another op (tied LM head)
    variant: OpVariant = OpVariant.REFERENCE  # how the implementation runs it (its own formula)
    chunks: int = 0  # chunked losses: sequence chunks (0: the formula derives them)
    moe: MoeConfig | None = None  # mixture-of-experts ops: experts, top-k, rows per expert


class MeshDim(StrEnum):
    """The parallel dimension whose group runs a collective (the report splits time by it)."""

    TP = "tp"  # tensor (and sequence) parallelism
    CP = "cp"  # context parallelism
    EP = "ep"  # expert parallelism


class CollectiveCall(BaseModel):
    """One collective an op runs: its kind, the bytes of the whole tensor (not a shard, as NCCL's
    and nccl-tests' sizes count), the group's size and how many of it share this rank's node.

    ``overlap`` is the share of the op's own kernel time the collective runs beside (issued
    before a computation it is not waited for in): only what that does not hide is on the
    critical path. ``calls`` is how many such collectives the op runs."""

    model_config = ConfigDict(frozen=True)
    kind: Collective
    n_bytes: float
    group_size: int
    ranks_per_node: int
    dimension: MeshDim = MeshDim.TP
    overlap: float = Field(default=0.0, ge=0.0, le=1.0)
    calls: int = Field(default=1, ge=1)


class OpContext(BaseModel):
    """Everything a formula needs besides the spec: sizes, precision, the inputs it receives."""

    model_config = ConfigDict(frozen=True)
    batch: int  # B
    seq_len: int  # T
    precision: PrecisionSpec
    inputs: tuple[TensorInfo, ...] = ()

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


class LayerCost(BaseModel):
    """The cost of one op for one micro-batch.

    Memory fields describe autograd's behaviour: which inputs the op saves for backward, whether
    it saves its own output, which extra tensors it saves (masks, statistics, copies), and the
    transient bytes that exist only inside its forward or backward.
    """

    model_config = ConfigDict(frozen=True)

    fwd_flops: float = 0.0  # model FLOPs (matmuls and attention products only)
    bwd_input_flops: float = 0.0
    bwd_weight_flops: float = 0.0
    exec_fwd_flops: float | None = None  # FLOPs the kernel executes, if not fwd_flops (causal flash)
    exec_bwd_flops: float | None = None
    fwd_bytes_moved: float = 0.0
    bwd_bytes_moved: float = 0.0
    fwd_kernels: int = 1
    bwd_kernels: int = 1
    matmul: bool = False  # runs at the policy's matmul precision
    gemm: GemmShape | None = None  # the matmul's shape (its efficiency falls off for small ones)
    attention: AttentionShape | None = None  # the attention call (its kernel's measured rate)
    ring_ranks: int = 1  # context parallelism: the attention runs as a ring of this many blocks
    fwd_collectives: tuple[CollectiveCall, ...] = ()  # collectives the forward waits for
    bwd_collectives: tuple[CollectiveCall, ...] = ()  # ... the backward
    output: TensorInfo
    output_is_view: bool = False  # the output shares its first input's storage (allocates nothing)
    saves_inputs: tuple[bool, ...] = ()
    saves_output: bool = False
    saved_extra_bytes: tuple[int, ...] = ()  # tensors the op creates and keeps for backward
    extras_are_outputs: bool = False  # those extras are outputs of its kernel (SAC's cache keeps them)
    autocast_copy_bytes: tuple[int, ...] = ()  # autocast's cached low-precision weight copies
    # False: autocast does not cache them (a view's cast): in a checkpointed unit's forward they die with the op
    autocast_copies_cached: bool = True
    fwd_transient_bytes: int = 0  # beyond inputs, output and extras, at the op's forward peak
    # beyond inputs and output when the op runs inside a checkpointed unit (nothing is saved,
    # so a composite op frees its internal tensors as it goes); None: extras + fwd_transient
    unsaved_fwd_transient_bytes: int | None = None
    bwd_transient_bytes: int = 0  # beyond input grads, at the op's backward peak
    grad_aliases_inputs: tuple[bool, ...] = ()  # input grads that are the output grad itself (add)
    # the backward's first node is the output gradient's last reader: where no other op shares
    # that gradient (no alias), it is freed before the backward's peak
    releases_output_grad: bool = False
    param_numel: int = 0
    param_dtype: DType = DType.FP32
    has_backward: bool = True
    # the output is written into a buffer the rank holds for the whole step (a pipeline stage's
    # receive buffer): the op allocates nothing
    output_preallocated: bool = False
    # its gradient lives until the step ends (a pipeline stage input's ``.grad``)
    keeps_grad: bool = False
    # everything the op saves exists before its kernel runs (a matmul saves its inputs, not its
    # output): a checkpoint recompute that ends on this op stops before running it
    saves_before_compute: bool = False
    # of fwd_flops: what a recompute that ends on this op does not run again (a composite op whose
    # last matmul packs its inputs before running)
    unrun_tail_flops: float = 0.0

    def saves_input(self, position: int) -> bool:
        return position < len(self.saves_inputs) and self.saves_inputs[position]

    def grad_aliases_input(self, position: int) -> bool:
        return position < len(self.grad_aliases_inputs) and self.grad_aliases_inputs[position]

    @property
    def bwd_flops(self) -> float:
        return self.bwd_input_flops + self.bwd_weight_flops

    @property
    def fwd_exec(self) -> float:
        return self.fwd_flops if self.exec_fwd_flops is None else self.exec_fwd_flops

    @property
    def bwd_exec(self) -> float:
        return self.bwd_flops if self.exec_bwd_flops is None else self.exec_bwd_flops


class AllocSequence:
    """A small helper for formulas: replay an op's internal allocations to find its peak.

    ``transient_over(final)`` is how far the peak inside the op rises above what it leaves
    allocated at the end (output + saved extras).
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def alloc(self, n_bytes: int) -> AllocSequence:
        self.live += n_bytes
        self.peak = max(self.peak, self.live)
        return self

    def free(self, n_bytes: int) -> AllocSequence:
        self.live -= n_bytes
        return self

    def transient_over(self, final_bytes: int) -> int:
        return max(0, self.peak - final_bytes)


def linear_flops(tokens: int, in_features: int, out_features: int) -> float:
    """x[tokens, in] @ W[in, out]: 2 * tokens * in * out (lecture: 2 * B * D * K)."""
    return 2.0 * tokens * in_features * out_features


__all__ = [
    "AllocSequence",
    "CollectiveCall",
    "Field",
    "LayerCost",
    "LayerSpec",
    "MeshDim",
    "OpContext",
    "OpKind",
    "OpVariant",
    "HIDDEN_STATE_LOSSES",
    "ParamTensor",
    "TensorInfo",
    "linear_flops",
]
