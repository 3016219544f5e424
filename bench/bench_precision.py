"""Speed and memory of the precision modes on one model, measured in one process.

Any of the five paper models, trained by the engine itself (Trainer.train_iteration, i.e.
the task's own train_step through the step context) on the model's quick preset, or at
a tiny or the paper's size (--size). Every mode gets its own Trainer over the same
batches (the first --steps batches of the engine's own stream, pre-generated on the host
and moved to the device outside the timed region, as the engine's loop does). Modes are
timed in interleaved rounds, the order rotating every round, so machine noise hits every
mode alike; the speed-up is the median over rounds of the paired ratio to the first mode.

Reported per mode: throughput in the task's own unit (task.count / count_unit: samples,
tokens, images, audio seconds), step time p50/p90 (runner.measure.StepTimer: CUDA events
on a GPU, perf_counter on a CPU), on a CPU the process CPU time per step and its paired
speed-up (less disturbed by other processes than wall time), activation bytes saved for backward
(runner.measure.SavedActivations, on the batch that counts most) and their ratio to the
first mode, and on CUDA the mode's own peak allocated / reserved memory (see
`CudaMemory`). A mode that cannot run here is a row "n/a: <reason>".

    python bench/bench_precision.py --model biglstm                    # quick_biglstm on this machine
    python bench/bench_precision.py --model dcgan --size tiny --threads 1 --rounds 3 --steps 3
    python bench/bench_precision.py --experiment quick_ssd --modes fp32 pseudo_fp16
    python bench/bench_precision.py --model resnet50 --paper-size --modes fp32 tf32 mp amp bf16_amp \\
        --steps 20 --rounds 3                                           # ResNet-50, 224 px, batch 256, on a GPU
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_trainer, device_label, host_batches  # noqa: E402

from runner.engine import Trainer, resolve_device  # noqa: E402
from runner.errors import UserError  # noqa: E402
from runner.measure import StepTimer  # noqa: E402

MODELS = ("resnet50", "ssd", "biglstm", "dcgan", "deepspeech")
DEFAULT_MODES = ("fp32", "mp", "amp", "pseudo_fp16", "bf16")
FP32_MODES = ("fp32", "tf32")        # take no loss scale
BF16_MODES = ("bf16", "bf16_amp")    # FP32's range: no loss scale needed

# Sizes on top of the model's quick preset (`experiment=quick_<model>`; "quick" adds nothing).
# Every size keeps the built-in synthetic data, so nothing needs to be on disk.
SIZES: dict[str, dict[str, list[str]]] = {
    # The tests' tiny variants (tests/test_<model>.py): seconds per step even in FP16 on a CPU.
    "tiny": {
        "resnet50": ["model.width=0.125", "model.depth=[1,1,1,1]", "data.image_size=16", "data.batch_size=8"],
        "ssd": ["data.batch_size=4"],
        "biglstm": ["model.emb_size=16", "model.hidden_size=32", "model.proj_size=16", "model.num_samples=64",
                    "data.vocab_size=1000", "data.num_classes=10", "data.batch_size=8", "data.unroll=10"],
        "dcgan": ["model.width=4", "data.batch_size=16"],
        "deepspeech": ["model.conv_channels=4", "model.rnn_hidden=32", "model.lookahead=3", "data.batch_size=4"],
    },
    "quick": {m: [] for m in MODELS},
    # The paper's networks (configs/experiment/paper_<model>.yaml) on synthetic data, at a batch
    # that fits one 80 GB GPU.
    "paper": {
        # torchvision ResNet-50, 224 px, batch 256, 1000 classes
        "resnet50": ["model.width=1.0", "model.depth=[3,4,6,3]", "data.image_size=224", "data.batch_size=256",
                     "data.num_classes=1000"],
        # SSD300-VGG16, batch 32 (the Caffe recipe's); 3 synthetic classes instead of VOC's 20
        "ssd": ["model.variant=ssd300", "data.batch_size=32"],
        # BIG LSTM: 2 x 8192 LSTMP -> 1024, 8192 samples, vocabulary 793,450 (the nearest multiple
        # of the corpus' 50 word classes to 1B Word's 793,471), 128 rows x 20 steps (one of the
        # paper's GPUs)
        "biglstm": ["model.emb_size=1024", "model.hidden_size=8192", "model.proj_size=1024", "model.num_layers=2",
                    "model.num_samples=8192", "data.vocab_size=793450", "data.num_classes=50",
                    "data.batch_size=128", "data.unroll=20", "data.num_train_tokens=400000",
                    "data.num_eval_tokens=1000"],
        # 128 px DCGAN at width 64, batch 128 (issue 11's GPU setting; the paper gives no batch)
        "dcgan": ["model.image_size=128", "model.width=64", "data.image_size=128", "data.batch_size=128"],
        # DS2 at the paper's ~115M parameters, batch 32 of 20-30 word synthetic utterances
        # (7.9-14.2 s, mean 10.9 s: LibriSpeech's typical lengths)
        "deepspeech": ["model.conv_channels=32", "model.rnn_hidden=1824", "model.rnn_layers=3",
                       "model.bidirectional=true", "model.lookahead=20", "data.batch_size=32",
                       "data.min_words=20", "data.max_words=30"],
    },
}
# Smaller data sets where building them costs time (the bench needs only a few batches):
# DeepSpeech's length buckets render every utterance's waveform up front.
LEAN = {"deepspeech": ["data.num_train=256", "data.num_eval=8"]}


def scale_for(mode: str, scale: str) -> str:
    return "none" if mode in FP32_MODES or mode in BF16_MODES else scale


def one_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}"[:160]


class CudaMemory:
    """One mode's own peak allocated / reserved bytes while other modes' Trainers stay resident.

    Other modes' tensors do not change while this mode runs, so (peak - allocated before the
    mode was built) is this mode's peak alone: exact for allocated bytes. Reserved bytes are
    the growth of the caching allocator's pool over the same window after empty_cache():
    approximate, since a mode may reuse free blocks left in segments held by other modes.
    During the timed rounds the peak is (this mode's resident bytes) + (the round's peak
    above what was allocated when the round began).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_allocated = self.peak_reserved = 0
        self._base_allocated = self._base_reserved = self._round_start = 0
        self.resident = 0

    def start_mode(self) -> None:
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base_allocated = torch.cuda.memory_allocated(self.device)
        self._base_reserved = torch.cuda.memory_reserved(self.device)

    def end_warmup(self) -> None:
        torch.cuda.synchronize(self.device)
        self.peak_allocated = torch.cuda.max_memory_allocated(self.device) - self._base_allocated
        self.peak_reserved = torch.cuda.max_memory_reserved(self.device) - self._base_reserved
        self.resident = torch.cuda.memory_allocated(self.device) - self._base_allocated

    def start_round(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
        self._round_start = torch.cuda.memory_allocated(self.device)

    def end_round(self) -> None:
        transient = torch.cuda.max_memory_allocated(self.device) - self._round_start
        self.peak_allocated = max(self.peak_allocated, self.resident + transient)


@dataclass
class ModeResult:
    mode: str
    scale: str
    error: str | None = None
    trainer: Trainer | None = None
    timer: StepTimer | None = None
    round_ms: list[float] = field(default_factory=list)       # mean wall ms per step, per round
    round_cpu_ms: list[float] = field(default_factory=list)   # mean process CPU ms per step, per round
    activation_bytes: int | None = None
    memory: CudaMemory | None = None


def build_mode(mode: str, args: argparse.Namespace, base: list[str], batches: list[dict[str, Any]] | None,
               device: torch.device) -> tuple[ModeResult, list[dict[str, Any]] | None]:
    """A Trainer for `mode`, warmed up (activation bytes measured on the first warm-up step)."""
    scale = scale_for(mode, args.scale)
    result = ModeResult(mode, scale)
    if device.type == "cuda":
        result.memory = CudaMemory(device)
        result.memory.start_mode()
    try:
        trainer = bench_trainer([*base, f"precision={mode}", f"scale={scale}"], f"{args.out_root}/{mode}")
        if batches is None:
            batches = host_batches(trainer, args.steps)
        counts = [trainer.task.count(b) for b in batches]
        largest = batches[counts.index(max(counts))]
        for i in range(args.warmup):  # allocator, cudnn autotune, lazy optimizer state
            trainer.train_iteration(trainer.to_device(largest if i == 0 else batches[i % len(batches)]),
                                    measure_memory=i == 0)
            trainer.step += 1
        result.activation_bytes = trainer.activation_bytes
        if result.memory:
            result.memory.end_warmup()
        result.trainer, result.timer = trainer, StepTimer(trainer.device, warmup_steps=0)
    except (RuntimeError, NotImplementedError, UserError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        result.error = one_line(exc)
        result.trainer = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result, batches


def timed_round(r: ModeResult, batches: list[dict[str, Any]]) -> None:
    """One round of len(batches) engine iterations, each timed like the engine's loop times it."""
    t, timer = r.trainer, r.timer
    if r.memory:
        r.memory.start_round()
    cpu0 = time.process_time()
    for host in batches:
        count = t.task.count(host)
        batch = t.to_device(host)
        timer.start()
        t.train_iteration(batch, measure_memory=False)
        timer.stop(count)
        t.step += 1
    timer.flush()  # one synchronize (CUDA) for the round's events
    r.round_cpu_ms.append((time.process_time() - cpu0) * 1e3 / len(batches))
    r.round_ms.append(sum(timer.durations_ms[-len(batches):]) / len(batches))
    if r.memory:
        r.memory.end_round()


def base_overrides(model: str, args: argparse.Namespace) -> list[str]:
    experiment = args.experiment or f"quick_{model}"
    size = "paper" if args.paper_size else args.size
    extra = [f"threads={args.threads}"] if args.threads else []
    lean = LEAN.get(model, []) if experiment.startswith("quick_") else []  # synthetic data only
    return [f"experiment={experiment}", *lean, *SIZES[size][model], f"device={args.device}",
            "trainer.timing_warmup_steps=0", *extra, *args.set]


def bench_model(model: str, args: argparse.Namespace) -> dict[str, Any]:
    base = base_overrides(model, args)
    device = resolve_device(args.device)
    results: list[ModeResult] = []
    batches: list[dict[str, Any]] | None = None
    for mode in args.modes:
        r, batches = build_mode(mode, args, base, batches, device)
        results.append(r)
    running = [r for r in results if r.trainer is not None]
    for k in range(args.rounds):
        shift = k % max(len(running), 1)  # rotate the order: no mode always runs first
        for r in running[shift:] + running[:shift]:
            if r.error:
                continue
            try:
                timed_round(r, batches)
            except RuntimeError as exc:  # e.g. out of memory at a later, larger batch
                r.error = one_line(exc)
                r.trainer = None
    return report(model, args, base, results, device, batches)


def report(model: str, args: argparse.Namespace, base: list[str], results: list[ModeResult],
           device: torch.device, batches: list[dict[str, Any]] | None) -> dict[str, Any]:
    ok = [r for r in results if r.error is None and r.round_ms]
    ref = results[0] if results and results[0] in ok else None
    trainer = ok[0].trainer if ok else None  # the task's unit and the model's size
    unit = trainer.task.count_unit if trainer else "samples"
    cuda = device.type == "cuda"
    params = sum(p.numel() for p in trainer.model.parameters()) if trainer else None
    counts = [trainer.task.count(b) for b in batches] if trainer and batches else []
    rows = []
    for r in results:
        row: dict[str, Any] = {"mode": r.mode, "scale": r.scale}
        if r.error or not r.round_ms:
            row["na"] = r.error or "did not run"
            rows.append(row)
            continue
        s = r.timer.summary()
        row.update(throughput=s["samples_per_s"], step_ms_p50=s["step_time_ms_p50"], step_ms_p90=s["step_time_ms_p90"],
                   cpu_ms_per_step=statistics.median(r.round_cpu_ms), activation_bytes=r.activation_bytes,
                   round_ms=r.round_ms)
        if ref is not None:
            row["speedup"] = statistics.median(b / a for a, b in zip(r.round_ms, ref.round_ms))
            row["cpu_speedup"] = statistics.median(b / a for a, b in zip(r.round_cpu_ms, ref.round_cpu_ms))
            if r.activation_bytes and ref.activation_bytes:
                row["activation_ratio"] = r.activation_bytes / ref.activation_bytes
        if r.memory:
            row.update(peak_allocated_bytes=r.memory.peak_allocated, peak_reserved_bytes=r.memory.peak_reserved)
        rows.append(row)
    return {"model": model, "device": device_label(device), "torch": torch.__version__,
            "cuda": torch.version.cuda if cuda else None, "overrides": base, "params": params, "unit": unit,
            "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
            "count_per_step": statistics.mean(counts) if counts else None, "rows": rows}


def markdown(res: dict[str, Any]) -> str:
    cuda = res["cuda"] is not None
    ref = res["rows"][0]["mode"] if res["rows"] else "fp32"
    unit = res["unit"]
    lines = [f"{res['model']}: {res['device']}, torch {res['torch']}" + (f" (CUDA {res['cuda']})" if cuda else "")
             + f"; {res['params'] / 1e6:.2f}M params; {res['count_per_step']:.4g} {unit}/step"
             if res["params"] else f"{res['model']}: {res['device']}, torch {res['torch']}",
             f"overrides: {' '.join(res['overrides'])}",
             f"{res['rounds']} interleaved rounds x {res['steps']} steps ({res['warmup']} warm-up steps per mode)", ""]
    head = ["mode", "scale", f"{unit}/s", "step ms p50", "p90", f"speed-up vs {ref}"]
    head += ["peak alloc MiB", "peak reserved MiB"] if cuda else ["CPU ms/step", "CPU-time speed-up"]
    head += ["activation MiB", f"act. vs {ref}"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in res["rows"]:
        if "na" in row:
            cells = [row["mode"], row["scale"], f"n/a: {row['na']}"] + [""] * (len(head) - 3)
        else:
            cells = [row["mode"], row["scale"], f"{row['throughput']:.4g}", f"{row['step_ms_p50']:.1f}",
                     f"{row['step_ms_p90']:.1f}", f"{row['speedup']:.2f}x" if "speedup" in row else "–"]
            cells += ([f"{row['peak_allocated_bytes'] / 2**20:.0f}", f"{row['peak_reserved_bytes'] / 2**20:.0f}"]
                      if cuda else [f"{row['cpu_ms_per_step']:.1f}",
                                    f"{row['cpu_speedup']:.2f}x" if "cpu_speedup" in row else "–"])
            act = row["activation_bytes"]
            cells += [f"{act / 2**20:.2f}" if act else "–",
                      f"{row['activation_ratio']:.2f}" if "activation_ratio" in row else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", choices=MODELS, help="one or more models (default: resnet50)")
    p.add_argument("--experiment", help="a preset instead of quick_<model>, e.g. quick_ssd (one model)")
    p.add_argument("--size", choices=sorted(SIZES), default="quick",
                   help="quick: the quick preset as it is; tiny: the tests' sizes; paper: the paper's networks")
    p.add_argument("--paper-size", action="store_true", help="same as --size paper")
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), help="the first is the reference")
    p.add_argument("--scale", default="dynamic", help="loss scale of the FP16 modes (bf16 modes: none)")
    p.add_argument("--steps", type=int, default=3, help="steps per timed round (distinct batches)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode before the rounds")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more mpt-run overrides")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--out-root", default="/tmp/mpt-bench-precision", help="where the Trainers' run dirs go")
    args = p.parse_args(argv)
    if args.experiment:
        name = args.experiment.removeprefix("quick_").removeprefix("paper_")
        if name not in MODELS or (args.model and args.model != [name]):
            p.error(f"--experiment {args.experiment} must name one model's preset (quick_<model> or paper_<model>)")
        args.model = [name]
    args.model = args.model or ["resnet50"]
    if min(args.steps, args.rounds, args.warmup) < 1:
        p.error("--steps, --rounds and --warmup must be 1 or more")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        resolve_device(args.device)
    except UserError as exc:
        print(f"bench_precision: {exc}", file=sys.stderr)
        sys.exit(2)
    results = []
    for model in args.model:
        res = bench_model(model, args)
        print(markdown(res) + "\n", flush=True)
        results.append(res)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
