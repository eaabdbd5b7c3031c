"""The GPU side of benchmarks.step_profile: kernels of a device trace by module, and the device's busy time."""
from __future__ import annotations

from benchmarks.step_profile import device_pids, kernel_times


def _trace() -> list[dict]:
    """Host process 1; GPU process 2 with two streams (kernels) and a summary line that repeats them."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "Stream #14(MemcpyD2D)"}},
        {"ph": "M", "pid": 2, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]

    def kernel(tid: int, ts: float, dur: float, name: str, module: str) -> dict:
        return {"ph": "X", "pid": 2, "tid": tid, "ts": ts, "dur": dur, "name": name,
                "args": {"hlo_module": module, "hlo_op": "op"}}

    return meta + [
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 500, "name": "PjitFunction(layer)"},
        kernel(7, 0, 100, "gemv_bf16", "jit_layer(123)"),
        kernel(7, 100, 50, "paged_attention", "jit_layer(123)"),
        kernel(8, 120, 60, "copy", "jit_store_kv"),  # overlaps the attention kernel by 30
        kernel(7, 300, 40, "gemv_bf16", "jit_head_logits"),
        kernel(9, 0, 150, "fusion", "jit_layer(123)"),  # the summary line: not counted again
    ]


def test_kernels_grouped_by_module_and_busy_time_is_their_union():
    events = _trace()
    assert device_pids(events) == {2}
    by_module, by_kernel, busy, launches = kernel_times(events, steps=2)
    assert by_module == {"jit_layer": 75.0, "jit_store_kv": 30.0, "jit_head_logits": 20.0}
    assert by_kernel["jit_layer: gemv_bf16"] == 50.0
    assert busy == (180 + 40) / 2  # [0, 180) and [300, 340): overlapping kernels count once
    assert launches == 4 / 2  # the summary line's event is not a launch


def test_a_cpu_trace_has_no_device_process():
    assert device_pids([e for e in _trace() if e.get("pid") == 1]) == set()
