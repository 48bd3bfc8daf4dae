"""Reading a profiled training step (`bench step --profile`): where the GPU time went and where
the GPU sat idle."""

from __future__ import annotations

__all__ = ["idle_gaps", "print_idle", "print_profile"]


def idle_gaps(kernels, start: float, end: float, min_us: float = 20.0) -> tuple[float, list]:
    """GPU kernels [(begin_us, end_us, name)] within a step's window [start, end] -> (busy us,
    the idle gaps of at least `min_us`, longest first, each (begin_us, length_us, kernel before,
    kernel after), None at the window's edges). Overlapping kernels count once."""
    busy, gaps, last_end, last_name = 0.0, [], start, None
    for b, e, name in sorted(kernels):
        b, e = max(b, start), min(e, end)
        if e <= last_end or b >= end:
            continue
        if b - last_end >= min_us:
            gaps.append((last_end, b - last_end, last_name, name))
        busy += e - max(b, last_end)
        last_end, last_name = e, name
    if end - last_end >= min_us:
        gaps.append((last_end, end - last_end, last_name, None))
    return busy, sorted(gaps, key=lambda g: -g[1])


def print_idle(events, step_range: str, top: int = 12) -> None:
    """Where the GPU waited during the profiled step: its idle time, the longest gaps, and the
    innermost host op running at each gap's start (a sync or slow host code shows there)."""
    from torch.autograd import DeviceType

    step = next(e for e in events if e.name == step_range and e.device_type == DeviceType.CPU)
    start, end = step.time_range.start, step.time_range.end
    # GPU work only: record_function ranges (the step, compiled graphs, the optimizer) are
    # listed as CUDA events too, and would hide the gaps they span
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in events
               if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    host = [e for e in events if e.device_type == DeviceType.CPU and e is not step]
    busy, gaps = idle_gaps(kernels, start, end)
    idle = end - start - busy
    print(f"--- GPU idle: {idle / 1e3:.2f} ms of the step's {(end - start) / 1e3:.2f} ms "
          f"(gaps >= 20 us: {sum(g[1] for g in gaps) / 1e3:.2f} ms in {len(gaps)}) ---")
    for b, length, before, after in gaps[:top]:
        inner = [e for e in host if e.time_range.start <= b < e.time_range.end]
        op = min(inner, key=lambda e: e.time_range.end - e.time_range.start).name if inner else "-"
        print(f"{length / 1e3:8.2f} ms at +{(b - start) / 1e3:7.1f} ms  host: {op[:60]:60s} "
              f"after {str(before)[:50]} / before {str(after)[:50]}")


def print_profile(prof, name: str, step_range: str) -> None:
    """The profiled step's kernel table, its GPU idle gaps and its matmuls by input shape."""
    print(f"--- profile: {name} ---")
    events = prof.key_averages()
    print(events.table(sort_by="self_cuda_time_total", row_limit=70, max_name_column_width=90))
    print_idle(prof.events(), step_range)
    gemms = [e for e in prof.key_averages(group_by_input_shape=True)
             if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")]
    print(f"--- matmuls by input shape: {name} ---")
    for e in sorted(gemms, key=lambda e: -e.device_time_total):
        print(f"{e.key:12s} calls {e.count:4d}  GPU {e.device_time_total / 1e3:9.2f} ms  "
              f"shapes {e.input_shapes}")
