"""Tuned convolutions against ATen's default on the conv shapes of an SD1.5 UNet.

    python benchmarks/conv_tuning.py [--device cpu] [--resolution 256] [--batch 2] [--json out.json]

The UNet (SD1.5 architecture, random weights) is run once on the meta device to collect its
convolution problems. For each distinct problem: ATen's time and the tuned op's (median of
several calls, after tuning), the algorithm chosen and its workspace. Then the whole UNet
forward with ATen's convolutions and with tuned ones, the first tuned forward with no
records (cold: it tunes) and with records loaded from disk (warm: it does not), and memory
during tuning. GPU: pass --device cuda and --resolution 512 / 1024.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time

import torch

import shapecache as sc
from shapecache import _timing
from shapecache._extension import _C
from shapecache.diffusers import unet_inputs
from shapecache.ops import TuningDb


def sd15_unet(device, dtype):
    from diffusers import UNet2DConditionModel

    with torch.device(device):
        unet = UNet2DConditionModel(cross_attention_dim=768, sample_size=64).eval()
    return unet if dtype == torch.float32 else unet.to(dtype)


def conv_problems(batch, resolution, dtype) -> list[tuple]:
    """(input shape, weight shape, stride, padding, dilation, groups, bias) of every distinct conv."""
    unet = sd15_unet("meta", dtype)
    seen = {}

    def record(module, args):
        x = args[0]
        key = (tuple(x.shape), tuple(module.weight.shape), module.stride, module.padding, module.dilation,
               module.groups, module.bias is not None)
        seen[key] = seen.get(key, 0) + 1

    for m in unet.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_pre_hook(record)
    with torch.no_grad():
        unet(**unet_inputs(unet, resolution // 8, resolution // 8, batch))
    return sorted(seen.items(), key=lambda item: -torch.Size(item[0][0]).numel() * item[0][1][0])


def median_ms(call, device, repeats):
    return statistics.median(_timing.timings(call, device, repeats)) * 1e3


def peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--resolution", type=int, default=256, help="image side in pixels (latent = /8)")
    parser.add_argument("--batch", type=int, default=2, help="UNet batch (2: one image with guidance)")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or float16 (CUDA default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(0)
    report = {"device": str(device), "environment": _C.tuning_environment(device), "resolution": args.resolution,
              "batch": args.batch, "dtype": str(dtype)}

    # Per convolution problem.
    rows = []
    with torch.no_grad():
        for (x_shape, w_shape, stride, padding, dilation, groups, has_bias), count in conv_problems(
                args.batch, args.resolution, dtype):
            x = torch.randn(x_shape, device=device, dtype=dtype)
            w = torch.randn(w_shape, device=device, dtype=dtype)
            b = torch.randn(w_shape[0], device=device, dtype=dtype) if has_bias else None
            params = (list(stride), list(padding), list(dilation), groups)
            tuned = _C.tune_conv2d(x, w, b, *params)
            aten = median_ms(lambda: torch.nn.functional.conv2d(x, w, b, *params), device, args.repeats)
            ours = median_ms(lambda: torch.ops.shapecache.conv2d(x, w, b, *params), device, args.repeats)
            rows.append({"input": x_shape, "weight": w_shape, "stride": stride, "uses": count, "aten_ms": aten,
                         "tuned_ms": ours, "algorithm": tuned["algorithm"],
                         "workspace_bytes": tuned["workspace_bytes"]})
    report["convs"] = rows

    print(f"{report['environment']}; SD1.5 UNet convs at {args.resolution}x{args.resolution}, batch {args.batch}, "
          f"{dtype}")
    header = f"{'input':>20} {'weight':>18} {'s':>2} {'uses':>4} {'aten ms':>9} {'tuned ms':>9} {'ratio':>6} {'algorithm':>19} {'workspace':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{str(r['input']):>20} {str(r['weight']):>18} {r['stride'][0]:>2} {r['uses']:>4} {r['aten_ms']:>9.3f} "
              f"{r['tuned_ms']:>9.3f} {r['aten_ms'] / r['tuned_ms']:>6.2f} {r['algorithm']:>19} "
              f"{sc.budget.format_bytes(r['workspace_bytes']):>10}")
    weighted_aten = sum(r["aten_ms"] * r["uses"] for r in rows)
    weighted_tuned = sum(r["tuned_ms"] * r["uses"] for r in rows)
    print(f"all convs of one forward: aten {weighted_aten:.1f} ms, tuned {weighted_tuned:.1f} ms, "
          f"ratio {weighted_aten / weighted_tuned:.2f}")

    # The whole UNet: ATen vs tuned, cold vs warm tuning.
    unet = sd15_unet(device, dtype)
    inputs = unet_inputs(unet, args.resolution // 8, args.resolution // 8, args.batch)
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        unet(**inputs)
        aten_forward = median_ms(lambda: unet(**inputs), device, args.repeats)
        _C.tuning_clear()
        _C.tuning_take_unsaved()
        tuned_before = _C.tuning_stats()["tuned"]  # the counters are the process's
        db = f"{tmp}/tuning.json"
        handle = sc.tune_convs(unet, db=db)
        memory_before = peak_memory(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            memory_before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        unet(**inputs)  # tunes every problem
        cold = time.perf_counter() - start
        tuning_peak = peak_memory(device) - memory_before
        tuned_forward = median_ms(lambda: unet(**inputs), device, args.repeats)
        tuned_problems = _C.tuning_stats()["tuned"] - tuned_before
        _C.tuning_clear()
        loaded = TuningDb(db).load()
        start = time.perf_counter()
        unet(**inputs)  # records loaded: no tuning
        warm = time.perf_counter() - start
        sc.uncached(handle)
    report.update(aten_forward_ms=aten_forward, tuned_forward_ms=tuned_forward, cold_first_forward_s=cold,
                  warm_first_forward_s=warm, tuned_problems=tuned_problems, records_loaded=loaded,
                  tuning_peak_bytes=tuning_peak, workspace_bytes=_C.workspace_stats(device)["bytes"])
    print()
    print(f"UNet forward: aten {aten_forward:.1f} ms, tuned {tuned_forward:.1f} ms, "
          f"ratio {aten_forward / tuned_forward:.2f}")
    print(f"first tuned forward: cold (tunes {tuned_problems} problems) {cold:.2f} s, warm ({loaded} records "
          f"loaded) {warm:.2f} s, ratio {cold / warm:.1f}x")
    kind = "allocated" if device.type == "cuda" else "peak RSS growth"
    print(f"memory during tuning ({kind}): {sc.budget.format_bytes(tuning_peak)}; "
          f"workspace arena: {sc.budget.format_bytes(report['workspace_bytes'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
