"""`bench --train SIZE --explain`: the batch loader's time on these shards, stage by stage
(readers/stats.py), and what would help, each piece of advice drawn from a number of the run (the
stage that dominates, the idle share of the cores, the stored pixels decoded per output pixel), so a
run that shows no cause gets no advice for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..readers.stats import LoaderStats
from .bench_passes import Where, training_loader

BUSY_CORES = 0.75  # the process's share of all cores above which there are no idle cores to give threads
LARGE_STORED = 4.0  # stored pixels per output pixel above which a smaller pack --resize decodes less


@dataclass(frozen=True)
class Explanation:
    """The loader's stats for one epoch and the advice drawn from them."""

    stats: LoaderStats
    train: int
    advice: list[str]

    def to_json(self) -> dict[str, Any]:
        stats = self.stats
        return {
            "verdict": stats.verdict, "dominant": stats.dominant, "seconds": stats.seconds,
            "batches": stats.batches, "samples": stats.samples, "samples_per_second": stats.samples_per_second,
            "step": stats.step, "waits": stats.waits, "busy": stats.busy, "threads": stats.threads,
            "cpu_share": stats.cpu_share, "cores": stats.cores,
            "stored_pixels_per_output_pixel": stats.pixels_per_output_pixel, "advice": self.advice,
        }  # fmt: skip


def explain_training(where: Where, train: int, threads: int, device: str | None) -> Explanation:
    """One epoch of the loader as bench's training pass reads it (batches of 64, random crops and
    flips at `train`, `threads` decode threads; `device`'s path where given), its stats and advice."""
    dataset = where.open()
    cuda = device is not None and device.startswith("cuda")
    try:
        loader = training_loader(dataset, train, threads, device)
        for _ in loader:
            if cuda:  # the step waits for the batch's kernels, as a training step's use of it would
                import torch

                torch.cuda.synchronize(device)
    finally:
        dataset.close()
    stats = loader.stats()
    return Explanation(stats, train, advice(stats, train, device))


def advice(stats: LoaderStats, train: int, device: str | None = None) -> list[str]:
    """What would make this loader faster, from its own numbers (`device`: the device path it ran
    on, if any); the first line says what it delivers."""
    said = [
        f"the loader delivers {stats.samples_per_second:,.0f} samples/s ({stats.batches_per_second:,.1f} batches/s): "
        f"a training step slower than {_per_batch(stats)} a batch leaves it waiting on the model, not on the input"
    ]
    if stats.verdict == "compute-bound":
        said.append(
            f"the training loop waited {stats.input_share:.0%} of its time: the model, not the input, bounds it"
        )
        return said
    loads, dominant = stats.loads, stats.dominant
    share = loads[dominant] / stats.seconds if stats.seconds > 0 else 0.0
    if dominant in ("decode", "targets"):
        what = "decoding and cropping" if dominant == "decode" else "masks and boxes"
        if stats.cpu_share < BUSY_CORES and stats.threads < stats.cores:
            said.append(
                f"{what} dominates ({share:.0%} of the time) while this process used {stats.cpu_share:.0%} of "
                f"the {stats.cores} cores: more threads (workers={stats.cores}) can use the rest"
            )
        elif stats.cpu_share >= BUSY_CORES and device is None:
            said.append(
                f"{what} dominates ({share:.0%} of the time) with the cores {stats.cpu_share:.0%} busy: "
                "a GPU's decoder (loader(device='cuda')) or more cores would take it on"
            )
    if dominant == "decode" and stats.pixels_per_output_pixel >= LARGE_STORED:
        said.append(
            f"each output pixel comes from {stats.pixels_per_output_pixel:.1f} stored pixels: packing with "
            f"--resize {round(train / 0.875)} (the short side a {train} px crop needs) leaves less to decode"
        )
    if dominant == "storage":
        said.append(
            f"waiting for object storage dominates ({share:.0%} of the time): a cache on a local disk "
            "kept between runs (cache_dir=, a cache_limit= that holds the output) reads each shard once"
        )
    if dominant == "read":
        said.append(
            f"reading records dominates ({share:.0%} of the time): shards on a faster disk, or a page "
            "cache that holds them (the output's size under the free memory), read faster"
        )
    if dominant == "collate":
        said.append(f"joining and handing over batches dominates ({share:.0%} of the time): larger batches amortize it")
    return said


def _per_batch(stats: LoaderStats) -> str:
    seconds = 1 / stats.batches_per_second if stats.batches_per_second else 0.0
    return f"{seconds * 1000:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"
