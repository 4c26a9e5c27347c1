"""How long one engine step takes: DistServe's latency model (App. A), generalised.

DistServe models a prefill batch as ``C1*(4th^2 + 2thm) + C2*3ht2/b + C3`` (linear
layers compute-bound, attention memory-bound, a fixed overhead) and a decoding step
as ``C4*(4h^2 + 2hm) + C5*3ht`` (weights and KV read from memory). Our engines also
run *mixed* steps (colocated chunked prefill: prompt chunks and decodes share a
step), and on a CPU a decode step's compute grows with the batch, so one linear
model covers every step:

    T = c3 + c4 * W                      fixed per step; W = weight bytes read
      + c1 * F_prompt                    linear-layer FLOPs of prompt tokens
      + c2 * A_prompt                    prompt attention, q_size * sum of pair counts
      + c6 * F_decode                    linear-layer FLOPs of decode tokens past the knee
      + c5 * K_decode                    KV bytes the decode tokens read

With c6 = 0 and no prompt tokens this is DistServe's decode model; with no decode
tokens it is its prefill model (c3 + c4*W is its C3).

The knee (a roofline's ridge, in tokens): a step reads every weight once whatever
its batch, and while the batch is small its linear layers are bound by that read,
so more rows cost (almost) nothing until the step has `knee` rows. Only the decode
rows beyond the knee, after the step's prompt rows have filled it
(`decode_rows`), pay c6. With knee = 0 every decode row pays: the plain linear
model. On this CPU the fit finds a knee of about 6 (the grid profile's
decode steps cost the same at batch 1 and 4); a datasheet profile keeps 0.

Within a step of constant batch every term is linear in the counts, so a
`StepCost` reduces a (model, hardware, parallelism) triple to six per-count prices
and a knee, and the simulator evaluates a step with a handful of multiply-adds.

Attention "units" of a prompt chunk of c new tokens after k already computed are
(k + c)^2 - k^2, so a whole prompt of l tokens costs l^2 however it is chunked:
DistServe's t2 = sum of l_i^2.

Parallelism (App. A: "h, n and m divided by the tensor-parallel size"), priced as
pdserve splits a model (parallel/split.py, `split_problem`): a tensor rank holds whole
GQA groups and whole 32-column blocks of the MLP, dealt as evenly as they go, so where
tp does not divide them the slowest rank holds the larger share (`largest_part`: SmolLM2's
3 KV heads at tp 2 -> 2 of 3 groups on rank 0); each tp > 1 step adds two ring
all-reduces of the step's hidden states per layer. A pipeline of pp stages deals the
layers into pp runs, the first ones one larger; the first stage (the most layers) sets
the stage time. The LM head and the embedding are priced as DistServe's and DejaVu's
systems run them - split over the tensor ranks, spread over the stages - which pdserve
does not do (it runs them whole on the first stage's rank 0): under 1% of a large
model's step, and DejaVu's stage model (planner/dejavu.py) relies on the spread. A
request crosses every stage, so its latency is pp stage times plus the activation sends
between stages, while a new batch can enter every stage time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pdserve.parallel.split import COLUMN_BLOCK, largest_part, split_problem
from pdserve.planner.model_spec import ModelSpec, PlanInputError

COEFFICIENTS = ("c1", "c2", "c3", "c4", "c5", "c6")
FIELDS = (*COEFFICIENTS, "knee")


def decode_rows(prompt_tokens: float, decode_tokens: float, knee: float) -> float:
    """Decode tokens that pay linear-layer compute: the step's rows past `knee`
    once its prompt rows have taken their place (a step reads its weights anyway)."""
    return max(0.0, prompt_tokens + decode_tokens - knee) - max(0.0, prompt_tokens - knee)


@dataclass(frozen=True)
class Coefficients:
    """Seconds per unit of each step feature (see the module docstring)."""

    c1: float  # s per linear-layer FLOP of a prompt token
    c2: float  # s per prompt-attention unit (q_size * pair count)
    c3: float  # s fixed per step (per pipeline stage): scheduling, launches, sampling
    c4: float  # s per weight byte read in a step
    c5: float  # s per KV byte read by decode tokens
    c6: float = 0.0  # s per linear-layer FLOP of a decode token past the knee
    knee: float = 0.0  # rows a step's weight read covers (see `decode_rows`)

    def __post_init__(self) -> None:
        for name in FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise PlanInputError(f"coefficient {name} must be a number >= 0, got {value!r}")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, source: str) -> Coefficients:
        if not isinstance(d, dict):
            raise PlanInputError(f"{source}: 'coefficients' must be an object of c1..c6")
        missing = [c for c in COEFFICIENTS[:5] if c not in d]
        unknown = sorted(set(d) - set(FIELDS))
        if missing or unknown:
            raise PlanInputError(
                f"{source}: coefficients need c1..c5 (c6 and knee optional); "
                f"missing {missing}, unknown {unknown}"
            )
        return cls(**{k: d[k] for k in d})


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise PlanInputError(f"tp and pp must be >= 1, got tp={self.tp} pp={self.pp}")

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"TP{self.tp}xPP{self.pp}"


@dataclass(frozen=True)
class Interconnect:
    """Links the parallel parts of one instance use."""

    tp_bandwidth: float = 0.0  # bytes/s of an all-reduce link (0: tp must be 1)
    tp_latency_s: float = 0.0  # fixed cost of one all-reduce
    pp_bandwidth: float = 0.0  # bytes/s between pipeline stages (0: pp must be 1)
    pp_latency_s: float = 0.0  # fixed cost of one stage-to-stage hand-off


@dataclass(frozen=True)
class StepCost:
    """Prices of one pipeline stage's step, in seconds per count.

    stage_time = base + prompt_token * (prompt tokens) + prompt_unit * (attention
    units) + prompt_seq * (prompts finishing: their LM-head row) + decode_token *
    (decode rows past the knee, `decode_rows`) + decode_comm * (decode tokens: the
    all-reduces every row pays, knee or not) + context_token * (context tokens the
    decode tokens attend to). A request's latency through the pipeline is `stages`
    stage times plus `hop_fixed + hop_token * tokens` per stage boundary.
    """

    base: float
    prompt_token: float
    prompt_unit: float
    prompt_seq: float
    decode_token: float
    context_token: float
    stages: int = 1
    hop_token: float = 0.0
    knee: float = 0.0
    decode_comm: float = 0.0
    hop_fixed: float = 0.0

    def stage_time(
        self,
        prompt_tokens: float = 0,
        prompt_units: float = 0,
        prompt_seqs: float = 0,
        decode_tokens: float = 0,
        context_tokens: float = 0,
    ) -> float:
        return (
            self.base
            + self.prompt_token * prompt_tokens
            + self.prompt_unit * prompt_units
            + self.prompt_seq * prompt_seqs
            + self.decode_token * decode_rows(prompt_tokens, decode_tokens, self.knee)
            + self.decode_comm * decode_tokens
            + self.context_token * context_tokens
        )

    def latency(self, stage_time: float, tokens: float) -> float:
        """Time for one batch to cross all stages, given its stage time."""
        return self.stages * stage_time + (self.stages - 1) * (
            self.hop_fixed + self.hop_token * tokens
        )

    def prefill_time(self, lengths: list[int]) -> float:
        """Latency of one prefill-only batch of fresh prompts (DistServe's T_prefill)."""
        t = sum(lengths)
        st = self.stage_time(t, sum(n * n for n in lengths), len(lengths))
        return self.latency(st, t)

    def decode_time(self, batch: int, context: int) -> float:
        """Latency of one decode step for `batch` requests holding `context` tokens."""
        return self.latency(self.stage_time(decode_tokens=batch, context_tokens=context), batch)


def step_cost(
    spec: ModelSpec,
    coeffs: Coefficients,
    par: Parallelism = Parallelism(),
    link: Interconnect = Interconnect(),
) -> StepCost:
    """Per-count prices for `spec` on hardware with `coeffs`, split as `par` says."""
    problem = split_problem(
        spec.num_kv_heads, spec.intermediate_size, spec.num_layers, par.tp, par.pp
    )
    if problem is not None:
        raise PlanInputError(f"{spec.name}: {problem}")
    if par.tp > 1 and link.tp_bandwidth <= 0:
        raise PlanInputError(f"tensor parallelism {par.tp} needs an all-reduce bandwidth")
    layers = largest_part(spec.num_layers, par.pp)  # the first stage's
    tp = par.tp
    heads = largest_part(spec.num_kv_heads, tp) / spec.num_kv_heads  # rank 0's GQA groups
    blocks = spec.intermediate_size // COLUMN_BLOCK
    columns = largest_part(blocks, tp) / blocks  # rank 0's MLP columns
    h = spec.hidden_size
    params = (2 * h * spec.q_size + 2 * h * spec.kv_size) * heads
    params += spec.ffn_matrices * h * spec.intermediate_size * columns
    act_bytes = h * spec.dtype_bytes  # one token's hidden state
    allreduce_token = 0.0
    allreduce_fixed = 0.0
    if tp > 1:
        ring = 2 * (tp - 1) / tp
        allreduce_token = 2 * layers * ring * act_bytes / link.tp_bandwidth
        allreduce_fixed = 2 * layers * link.tp_latency_s
    flops_token = 2 * params * layers
    head_flops = 2 * h * spec.vocab_size / tp  # LM head, last stage only
    stage_weights = params * spec.dtype_bytes * layers + spec.embedding_bytes / tp / par.pp
    kv_token = max(
        int(spec.kv_bytes_per_token_per_layer * heads), 2 * spec.head_dim * spec.dtype_bytes
    )
    hop = act_bytes / link.pp_bandwidth if par.pp > 1 and link.pp_bandwidth > 0 else 0.0
    if par.pp > 1 and link.pp_bandwidth <= 0:
        raise PlanInputError(f"pipeline parallelism {par.pp} needs a stage-to-stage bandwidth")
    head_share = 1.0 / par.pp  # the LM head runs on one stage of pp: spread it evenly
    return StepCost(
        base=coeffs.c3 + coeffs.c4 * stage_weights + allreduce_fixed,
        prompt_token=coeffs.c1 * flops_token + allreduce_token,
        prompt_unit=coeffs.c2 * spec.q_size * heads * layers,
        prompt_seq=coeffs.c1 * head_flops * head_share,
        decode_token=coeffs.c6 * (flops_token + head_flops * head_share),
        context_token=coeffs.c5 * kv_token * layers,
        stages=par.pp,
        hop_token=hop,
        knee=coeffs.knee,  # per device, tp divides weights and FLOPs alike: the ridge stays
        decode_comm=allreduce_token,
        hop_fixed=link.pp_latency_s if par.pp > 1 else 0.0,
    )


def step_features(
    spec: ModelSpec,
    prompt_tokens: int,
    prompt_units: int,
    prompt_seqs: int,
    decode_tokens: int,
    context_tokens: int,
    knee: float = 0.0,
) -> list[float]:
    """One step's feature values in coefficient order c1..c6 for a one-device instance.

    `step_cost(spec, c).stage_time(...)` equals the dot product of these with c when
    `knee` is c.knee; the profiler fits c by least squares over measured steps."""
    flops_token = 2 * spec.linear_params_per_layer * spec.num_layers
    head_flops = 2 * spec.hidden_size * spec.vocab_size
    return [
        flops_token * prompt_tokens + head_flops * prompt_seqs,
        spec.q_size * spec.num_layers * prompt_units,
        1.0,
        float(spec.weight_bytes),
        float(spec.kv_bytes_per_token * context_tokens),
        (flops_token + head_flops) * decode_rows(prompt_tokens, decode_tokens, knee),
    ]


def chunk_units(computed: int, new: int) -> int:
    """Attention units of `new` prompt tokens after `computed` ones: (k+c)^2 - k^2."""
    return (computed + new) ** 2 - computed**2
