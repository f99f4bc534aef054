"""The recipe: every setting of a run, from one TOML file plus `--set key=value` overrides.

A recipe is resolved (file + overrides) and validated into the typed `Recipe` below
before anything runs; a bad key or value is one `UserError` naming the key and where it
came from.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import tomli_w
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from frugality.errors import UserError
from frugality.models import FAMILIES, ModelConfig

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

# The allowed values of each setting, listed once: the packages that implement them
# (frugality.precision, frugality.compile.levels, frugality.tasks) read them from here.
Precision = Literal["auto", "fp32", "amp-bf16", "amp-fp16", "bf16-sr", "bf16", "fp8"]
CompileLevel = Literal["O0", "O1", "O2"]
TaskName = Literal["causal_lm", "masked_lm", "contrastive"]
DataParallel = Literal["ddp", "fsdp", "hsdp"]
# their values, in order, for choices and messages
PRECISIONS: tuple[str, ...] = get_args(Precision)
COMPILE_LEVELS: tuple[str, ...] = get_args(CompileLevel)
TASKS: tuple[str, ...] = get_args(TaskName)
DATA_PARALLEL: tuple[str, ...] = get_args(DataParallel)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataConfig(_Section):
    dataset: str = Field(
        default="bundled:gutenberg",
        description="A Megatron dataset prefix (PREFIX.bin + PREFIX.idx), or 'bundled:gutenberg' "
        "for the public-domain corpus shipped with frugality, tokenized on first use and cached.",
    )
    tokenizer: str = Field(default="pythia", description="'pythia', 'gpt2' or a tokenizer path")
    seq_len: PositiveInt = 2048
    global_batch_size: PositiveInt = Field(
        default=8, description="sequences per optimizer step, summed over data-parallel ranks"
    )
    micro_batch_size: PositiveInt = Field(
        default=8, description="sequences per forward pass on one device; the rest is accumulated"
    )
    val_fraction: float = Field(default=0.02, gt=0.0, lt=0.5)
    fields: tuple[str, str] | tuple[str, str, str] = Field(
        default=("query", "text"),
        description="contrastive: the JSONL fields of the query, the positive and (optionally) a hard negative",
        json_schema_extra={"task": "contrastive"},
    )
    buckets: tuple[PositiveInt, ...] = Field(
        default=(),
        description="contrastive: the padded lengths a batch may take besides seq_len (the "
        "longest); each is one compiled shape",
        json_schema_extra={"task": "contrastive"},
    )
    mask_prob: float = Field(
        default=0.15,
        gt=0.0,
        lt=1.0,
        description="masked_lm: share of tokens predicted",
        json_schema_extra={"task": "masked_lm"},
    )

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if any(b > self.seq_len for b in self.buckets):
            raise ValueError(f"buckets ({list(self.buckets)}) must not exceed seq_len ({self.seq_len})")
        if len({*self.buckets, self.seq_len}) > 4:  # x 2 (training, evaluation): dynamo's 8 graphs per code
            raise ValueError(
                f"buckets ({list(self.buckets)}): at most three besides seq_len (each is a compiled "
                "graph for training and one for evaluation)"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        return self


class OptimConfig(_Section):
    """AdamW with linear warm-up then cosine decay to `min_lr` (Pythia's schedule)."""

    lr: PositiveFloat = 1e-3
    min_lr: NonNegativeFloat = 1e-4
    warmup_steps: NonNegativeInt = 0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.1
    grad_clip: NonNegativeFloat = Field(default=1.0, description="max global grad norm; 0 = off")

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {list(self.betas)}")
        return self


class TrainConfig(_Section):
    steps: PositiveInt = 1000
    eval_interval: PositiveInt = 100
    eval_samples: PositiveInt = Field(
        default=64,
        description="validation samples per evaluation, the same ones every time and at any "
        "micro-batch and process count (all of the held-out split where it is smaller)",
    )
    eval_batches: PositiveInt | None = Field(
        default=None,
        description="older recipes' count of micro-batches: read as eval_samples = eval_batches x "
        "data.micro_batch_size (the samples it meant)",
    )
    save_interval: PositiveInt = 1000
    keep_checkpoints: PositiveInt = Field(default=2, description="newest checkpoints to keep")
    async_checkpoint: bool = Field(
        default=False,
        description="write checkpoints from a background thread while training goes on "
        "(the state is first copied to host memory: that much more of it); see docs/checkpoints.md",
    )
    on_nonfinite: Literal["skip", "rollback", "stop"] = Field(
        default="skip",
        description="a step whose loss or gradients are not finite (or whose loss spikes, "
        "train.loss_spike) is never applied: skip it and go on, rolling back after train.max_skipped in a "
        "row; roll back to the last checkpoint at once; or stop at once. Past train.max_rollbacks, stop",
    )
    max_skipped: PositiveInt = Field(default=3, description="consecutive skipped steps that roll the run back")
    max_rollbacks: NonNegativeInt = Field(
        default=1,
        description="rollbacks to the last checkpoint (with the rest of the epoch reshuffled) "
        "before a diverging run stops with exit status 3",
    )
    loss_spike: float | None = Field(
        default=None,
        gt=1.0,
        description="a step whose loss exceeds this many times the median of the "
        "last train.loss_spike_window applied steps is a bad step, like a non-finite one (unset: off)",
    )
    loss_spike_window: int = Field(default=50, ge=4, description="applied steps the loss-spike median spans")
    retries: NonNegativeInt = Field(
        default=0,
        description="frugality train reruns a crashed run from its latest valid checkpoint up to "
        "this many times (see frugality.training.supervisor)",
    )
    retry_backoff_s: NonNegativeFloat = Field(
        default=5.0, description="wait before the first retry, doubled for each one after"
    )
    step_timeout_s: PositiveFloat | None = Field(
        default=None,
        description="a step or evaluation that takes longer (after the first step) writes every "
        "thread's stack to hang-rank<R>.txt in the run directory and exits with status 5; unset: no watchdog",
    )
    activation_checkpointing: Literal["auto", "none", "full", "selective"] = Field(
        default="auto",
        description="recompute blocks' activations in backward instead of keeping them: full (every block), "
        "selective (every train.selective_every-th block), none; auto: the first of none, selective, full whose "
        "memory plan fits the memory free on the device (none where it is not checked); see docs/training.md",
    )
    selective_every: int = Field(
        default=2, ge=2, description="activation_checkpointing = selective: every this many blocks, one recomputed"
    )
    check_memory: bool = Field(
        default=True,
        description="refuse, before anything is written, a run whose memory plan (frugality "
        "plan) exceeds the memory free on its device",
    )
    preflight: bool = Field(
        default=False,
        description="run the quick health checks on every rank before step 1 (products, "
        "stochastic rounding, disk, and the collectives' values); refuse to start on a failure",
    )
    log_interval: PositiveInt = 1
    precision: Precision = Field(
        default="auto",
        description="auto: bf16-sr where bf16 products are native (AMX, AVX512-BF16, CUDA 8.0+), amp-fp16 on "
        "CUDA GPUs of compute capability 7.x (T4, V100), fp32 elsewhere; see frugality.precision and "
        "docs/precision.md",
    )
    loss_scale: float = Field(
        default=2.0**16,
        gt=0,
        description="amp-fp16: the initial loss scale (dynamic: halved on each overflow, that step skipped; "
        "doubled after train.loss_scale_window steps without one)",
    )
    loss_scale_window: PositiveInt = Field(
        default=2000, description="amp-fp16: steps without an overflow before the loss scale doubles"
    )
    tf32: bool = Field(
        default=True,
        description="CUDA GPUs of compute capability 8.0+: fp32 matrix products in TF32 (10-bit mantissa, "
        "several times faster); false keeps them in full fp32, for parity runs",
    )
    task: TaskName = Field(default="causal_lm", description="what is trained: see frugality.tasks")
    fused_optimizer: bool = Field(
        default=True,
        description="one fused update pass: bf16 policies' BF16AdamW (a C kernel on CPU, torch.compile "
        "elsewhere), float32 ones' torch AdamW(fused=True); false runs the same formula as eager torch ops "
        "(bf16) or torch's foreach AdamW (float32)",
    )
    device: str = Field(default="auto", description="'auto', 'cpu', 'cuda', 'cuda:1', 'xla' (docs/xla.md), ...")
    runs_dir: str = Field(default="runs", description="parent of the run directory")


class CompileConfig(_Section):
    """Ahead-of-time compilation with torch.compile; see frugality.compile and docs/compile.md."""

    level: CompileLevel = Field(
        default="O0",
        description="O0 eager; O1 each transformer block compiled once (Inductor defaults); "
        "O2 the same with autotuned matrix products (longer compile)",
    )
    cache: str | None = Field(
        default=None,
        description="where compiled graphs are shared: a directory or an fsspec URL "
        "(s3://bucket/prefix, file://...); default $FRUGALITY_COMPILE_CACHE, else the user cache",
    )
    cache_key_env: str = Field(
        default="FRUGALITY_CACHE_KEY",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="the environment variable holding the fleet key that signs published cache "
        "entries and that fetched ones must be signed with (unset: entries are not authenticated; "
        "docs/security.md). The key itself is never read from a recipe",
    )
    on_recompile: Literal["warn", "error"] = Field(
        default="warn", description="what a compilation after warm-up does: warn, or stop the run"
    )
    fallback: bool = Field(default=True, description="a graph that fails to compile runs eagerly (false: stop)")
    backend: str = Field(
        default="inductor",
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="the torch.compile backend of O1 and O2: inductor (whose graphs the shared cache holds), or "
        "another registered one (TorchNeuron's neuron where its wheels are installed), compiled without the cache",
    )
    xla_executables: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="on an xla device, XLA's executables kept in the shared cache beside Inductor's graphs: "
        "auto where the PJRT client loads them back (none with torch_xla 2.9; Neuron's compiler keeps its own "
        "cache), on for any client, off for none",
    )


class ParallelConfig(_Section):
    """How a run launched on several processes (torchrun) shares the work; see
    frugality.distributed and docs/distributed.md. One process ignores it."""

    data: DataParallel = Field(
        default="ddp",
        description="ddp: replicas, gradients all-reduced; fsdp: FSDP2, parameters, "
        "gradients and optimizer state sharded per transformer block; hsdp: FSDP2 sharded within "
        "groups of parallel.shard_size ranks, replicated across the groups",
    )
    shard_size: PositiveInt | None = Field(
        default=None,
        description="hsdp: ranks per shard group (default: the processes per node); must divide the world size",
    )
    reshard_after_forward: bool = Field(
        default=True,
        description="fsdp/hsdp: free each block's gathered parameters after its forward "
        "(gathered again for backward); false keeps them, trading memory for one all-gather less",
    )
    tensor: PositiveInt = Field(
        default=1,
        description="tensor-parallel degree: each block's attention heads and MLP columns, the embedding's and "
        "output layer's vocabulary split over this many ranks (consecutive ones: within a node); data parallel "
        "takes the ranks left over",
    )
    sequence: bool = Field(
        default=False,
        description="with tensor > 1: sequence parallel, the norms and the residual stream split along the "
        "sequence between the tensor-parallel layers (activations 1/tensor each)",
    )
    pipeline: PositiveInt = Field(
        default=1,
        description="pipeline-parallel degree: the decoder cut into this many stages by blocks (the embedding "
        "with the first, the final norm and output layer with the last), one a rank; data parallel takes the "
        "ranks left over",
    )
    pipeline_schedule: Literal["auto", "gpipe", "1f1b", "interleaved-1f1b"] = Field(
        default="auto",
        description="gpipe: all forwards, then all backwards; 1f1b: at most `pipeline` micro-batches' "
        "activations at once; interleaved-1f1b: two stages a rank, a smaller bubble; auto: 1f1b",
    )
    pipeline_microbatches: PositiveInt | None = Field(
        default=None,
        description="micro-batches a step drives through the stages, per data-parallel rank (it sets "
        "data.micro_batch_size); default: the step's micro-batches as data.micro_batch_size makes them",
    )
    timeout_s: PositiveInt = Field(default=600, description="a collective waiting longer fails the run")
    spmd: bool = Field(
        default=False,
        description="an xla device: one process drives every device of the PJRT client (a TPU host's chips; "
        "CPU_NUM_DEVICES on XLA's CPU client) through SPMD; ddp shards each micro-batch over them, fsdp the "
        "parameters (and the optimizer state with them) too; data.micro_batch_size is per device",
    )
    gather_negatives: bool = Field(
        default=False,
        description="contrastive training: each query is scored against every rank's documents "
        "(gathered, gradients flowing back), not only its own rank's: world-size times the in-batch negatives, "
        "as one process with world-size times the micro-batch",
        json_schema_extra={"task": "contrastive"},
    )


class MetricsConfig(_Section):
    peak_tflops: PositiveFloat | None = Field(
        default=None,
        description="the device's peak for MFU; measured (and cached) by a matmul probe when unset",
    )


class CostConfig(_Section):
    """What a run's machine costs and draws (see docs/cost.md for every default's source)."""

    instance: str | None = Field(default=None, description="a row of the price catalogue, e.g. trn1.32xlarge")
    price_per_hour: PositiveFloat | None = Field(default=None, description="USD per hour; overrides the catalogue's")
    catalogue: str | None = Field(default=None, description="a CSV of instances merged over the bundled catalogue")
    watts: PositiveFloat | None = Field(
        default=None, description="the machine's draw; declared, it replaces the energy meters"
    )
    pue: float | None = Field(
        default=None,
        ge=1.0,
        description="power usage effectiveness; default: the instance's provider's figure, else 1.0",
    )
    grid_gco2_per_kwh: NonNegativeFloat = Field(
        default=436.0, description="grid carbon intensity; default: world average 2022 (Ember)"
    )
    target_loss: PositiveFloat | None = Field(
        default=None, description="report the time, dollars and energy to reach this validation loss"
    )


class Recipe(_Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    description: str = ""
    seed: NonNegativeInt = 1234
    model: ModelConfig
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    compile: CompileConfig = CompileConfig()
    parallel: ParallelConfig = ParallelConfig()
    metrics: MetricsConfig = MetricsConfig()
    cost: CostConfig = CostConfig()

    @model_validator(mode="before")
    @classmethod
    def _eval_batches_as_samples(cls, raw: Any) -> Any:
        """`train.eval_batches` (older recipes, run directories) counted micro-batches: the
        samples it meant are kept as `train.eval_samples` (a bad value is left for the field's
        own check to name)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("train"), dict):
            return raw
        train, data = raw["train"], found if isinstance(found := raw.get("data"), dict) else {}
        batches = train.get("eval_batches")
        micro = data.get("micro_batch_size", DataConfig.model_fields["micro_batch_size"].default)
        if isinstance(batches, int) and batches > 0 and isinstance(micro, int) and micro > 0:
            train = {k: v for k, v in train.items() if k != "eval_batches"}
            raw = {**raw, "train": {**train, "eval_samples": batches * micro}}
        return raw

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})")
        return self

    def to_toml(self, shown: bool = False) -> str:
        """The recipe as TOML; `shown`: for reading (`frugality recipes NAME`), without the
        keys only another train.task reads (contrastive's data.fields, masked_lm's mask_prob)."""
        data = self.model_dump(mode="json", exclude_none=True)
        if shown:
            for section_name, section in data.items():
                fields = getattr(type(getattr(self, section_name, None)), "model_fields", {})
                for key, info in fields.items():
                    only = (
                        (info.json_schema_extra or {}).get("task") if isinstance(info.json_schema_extra, dict) else None
                    )
                    if only is not None and only != self.train.task and isinstance(section, dict):
                        section.pop(key, None)
        return tomli_w.dumps(data)

    def for_data_parallel(self, ranks: int, min_micro: int = 1) -> tuple[Recipe, str | None]:
        """This recipe over `ranks` data-parallel ranks, keeping its global batch: where
        `micro_batch_size` x ranks does not divide the global batch, the micro-batch becomes
        the largest that does (the rest accumulated), and a note says so for the run header.
        A global batch that the ranks cannot share evenly, or only in micro-batches under
        `min_micro` (the task's smallest), is a UserError."""
        d = self.data
        if d.global_batch_size % ranks:
            raise UserError(
                f"data.global_batch_size ({d.global_batch_size}) cannot be shared evenly by {ranks} "
                f"data-parallel ranks; choose a multiple of {ranks} (--set data.global_batch_size=N) "
                "or another process count"
            )
        per_rank = d.global_batch_size // ranks
        if per_rank % d.micro_batch_size == 0:
            return self, None
        micro = max(m for m in range(1, d.micro_batch_size + 1) if per_rank % m == 0)
        if micro < min_micro:
            raise UserError(
                f"data.global_batch_size ({d.global_batch_size}) over {ranks} ranks leaves {per_rank} "
                f"sample(s) per rank, and train.task {self.train.task} needs micro-batches of at least "
                f"{min_micro} that divide it; choose another global batch or process count"
            )
        note = (
            f"data.micro_batch_size {d.micro_batch_size} -> {micro}: the global batch of {d.global_batch_size} "
            f"over {ranks} ranks is {per_rank} each, {per_rank // micro} micro-batch(es) of {micro}"
        )
        return self.model_copy(update={"data": d.model_copy(update={"micro_batch_size": micro})}), note


def shipped_recipes() -> dict[str, Path]:
    """Recipes that ship inside the package, by name."""
    folder = resources.files("frugality") / "recipes"
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".toml")}


def find_recipe(name_or_path: str | None) -> Path:
    """A path to a TOML file, or the name of a shipped recipe ('tiny' when None)."""
    if name_or_path is None:
        name_or_path = "tiny"
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise UserError(f"recipe file {path} does not exist")
        return path
    shipped = shipped_recipes()
    if name_or_path not in shipped:
        raise UserError(
            f"no recipe named {name_or_path!r} (shipped: {', '.join(sorted(shipped))}; or give a path to a .toml file)"
        )
    return shipped[name_or_path]


def load_recipe(name_or_path: str | None = None, overrides: Sequence[str] = ()) -> Recipe:
    """Read, override and validate a recipe; problems are a UserError, a line each.
    `NAME:VARIANT` applies the recipe's `[variants.VARIANT]` table over it first (a
    parallel layout, say), then the overrides."""
    name_or_path, variant = split_variant(name_or_path)
    path = find_recipe(name_or_path)
    raw = _read(path)
    variants = _variants(raw.pop("variants", {}), path)
    if variant is not None:
        if variant not in variants:
            have = ", ".join(sorted(variants)) or "none"
            raise UserError(f"recipe {path}: no variant {variant!r} (its variants: {have})")
        table = dict(variants[variant])
        table.pop("description", None)
        _merge(raw, table)
        raw["name"] = f"{raw.get('name', path.stem)}-{variant}"
    from_cli: dict[str, str] = {}
    for item in overrides:
        key, value = _parse_override(item)
        _set_nested(raw, key, value, item)
        from_cli[key] = item
    raw.setdefault("name", path.stem)
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        raise UserError(_describe(e, path if variant is None else Path(f"{path}:{variant}"), from_cli)) from None


def split_variant(name_or_path: str | None) -> tuple[str | None, str | None]:
    """`gpt-neox-20b:tp8-pp4` -> ("gpt-neox-20b", "tp8-pp4"); a name or path without a
    variant comes back as it is."""
    if name_or_path is None or ":" not in name_or_path:
        return name_or_path, None
    base, _, variant = name_or_path.rpartition(":")
    if Path(name_or_path).exists() or not re.fullmatch(r"[A-Za-z0-9._-]+", variant):
        return name_or_path, None  # a path with a colon in it (C:/x.toml, a/b:c/r.toml)
    return base, variant


def recipe_variants(name_or_path: str) -> dict[str, str]:
    """A recipe's variants, name -> description."""
    path = find_recipe(name_or_path)
    variants = _variants(_read(path).get("variants", {}), path)
    return {name: str(table.get("description", "")) for name, table in variants.items()}


def _variants(variants, path: Path) -> dict[str, dict]:
    """A recipe's `[variants]`: a table of tables, one a variant."""
    if not isinstance(variants, dict):
        raise UserError(f"recipe {path}: variants: a table of [variants.NAME] tables (got {variants!r})")
    for name, table in variants.items():
        if not isinstance(table, dict):
            raise UserError(f"recipe {path}: variants.{name}: a table of keys (got {table!r})")
    return variants


def _read(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"recipe {path}: not valid TOML: {e}") from None


def _merge(raw: dict, table: dict) -> None:
    """`table`'s values over `raw`'s, table by table."""
    for key, value in table.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            _merge(raw[key], value)
        else:
            raw[key] = value


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
    try:  # a TOML value: 3e-4, true, [0.9, 0.95], "text"
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()  # a bare string such as cpu or runs/x
    return key, value


def _set_nested(raw: dict, key: str, value: Any, item: str) -> None:
    *parents, leaf = key.split(".")
    table = raw
    for part in parents:
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise UserError(f"--set {item}: {part!r} is a value, not a table")
    table[leaf] = value


def _describe(error: ValidationError, path: Path, from_cli: dict[str, str]) -> str:
    """A line per problem: where it came from (the `--set` flag behind it, else the file),
    which key, what is wrong."""
    return "\n".join(_describe_one(problem, path, from_cli) for problem in error.errors())


def _describe_one(problem: ErrorDetails, path: Path, from_cli: dict[str, str]) -> str:
    # A discriminated union puts the chosen family in the location: model.llama.hidden_size.
    loc = [p for i, p in enumerate(problem["loc"]) if not (i == 1 and problem["loc"][0] == "model" and p in FAMILIES)]
    key = ".".join(str(p) for p in loc)
    message = problem["msg"].removeprefix("Value error, ")
    if problem["type"] == "union_tag_invalid":
        key = "model.family"
        message = f"unknown model family {problem['input'].get('family')!r} (have: {', '.join(FAMILIES)})"
    elif problem["type"] == "extra_forbidden":
        message = "unknown key"
    elif problem["type"] == "missing" and loc and isinstance(loc[-1], int):  # an item of a list, e.g. betas
        key = ".".join(str(p) for p in loc[:-1])
        message = f"too few values (item {loc[-1]} is missing)"
    elif problem["type"] == "missing":
        message = "missing required key"
    elif "input" in problem and problem["type"] not in ("value_error", "assertion_error"):
        message = f"{message} (got {problem['input']!r})"
    flags = _flags_behind(key, message, problem["type"], from_cli)
    if not flags:
        source = f"recipe {path}"
    elif key in from_cli or any(key.startswith(k + ".") for k in from_cli):  # the flag's value, or in it
        source = f"--set {flags[0]}"
    else:  # a check across fields, one of them (or an unknown table) set on the command line
        source = " ".join(f"--set {item}" for item in flags) + f" (with recipe {path})"
    return f"{source}: {key}: {message}" if key else f"{source}: {message}"


def _flags_behind(key: str, message: str, kind: str, from_cli: dict[str, str]) -> list[str]:
    """The `--set` items a problem at `key` comes from: the key itself, a key inside an
    unknown table, or a field that a check across fields names in its message."""
    found = []
    for flag_key, item in from_cli.items():
        inside = key.startswith(flag_key + ".")  # an item of the value the flag set (optim.betas.1)
        if key and flag_key != key and not flag_key.startswith(key + ".") and not inside:
            continue
        if (
            flag_key == key
            or inside
            or kind == "extra_forbidden"
            or flag_key in message
            or re.search(rf"\b{re.escape(flag_key.rsplit('.', 1)[-1])}\b", message)
        ):
            found.append(item)
    return found
