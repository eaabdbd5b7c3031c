"""benchmarks.gpu_settings: the settings a run's own dispatch and host-loop measurements favour, and the defaults
wherever a measurement is missing, failed or does not clear the margin."""
from __future__ import annotations

import json

from benchmarks.dispatch_variants import ANY_SIZE_GRAPHS, NO_COMMAND_BUFFERS, VARIANTS
from benchmarks.gpu_settings import main, settings_words


def _dispatch(walls: dict[str, tuple[float, float] | None]) -> dict:
    """walls: variant -> (ms at 1 row, ms at 64 rows), None for a variant that failed."""
    variants = []
    for name, wall in walls.items():
        record = {"variant": name, "settings": VARIANTS[name], "seconds": 9.0}
        if wall is None:
            record["error"] = "over its 40 s"
        else:
            record["steps"] = [{"sequences": 1, "wall_ms": wall[0], "dispatch_ms": 1.0},
                               {"sequences": 64, "wall_ms": wall[1], "dispatch_ms": 1.0}]
        variants.append(record)
    return {"variants": variants}


def _host(walls: dict[int, float]) -> dict:
    return {"results": [{"rows": rows, "wall_ms_per_step": wall} for rows, wall in walls.items()]}


def _write(folder, dispatch=None, host=None, host_thread=None):
    for name, record in (("dispatch_smollm2_gpu.json", dispatch), ("host_loop_gpu.json", host),
                         ("host_loop_thread_gpu.json", host_thread)):
        if record is not None:
            (folder / name).write_text(json.dumps(record))


def test_the_fastest_variant_at_the_most_rows_and_the_thread_where_they_clear_the_margin(tmp_path):
    _write(tmp_path, _dispatch({"one layer a call": (5.5, 6.9), "no command buffers": (5.6, 7.0),
                                "8 layers a call": (4.9, 6.1), "graphs of any size": (4.0, 6.3),
                                "every layer in one call": None}),
           _host({1: 8.6, 64: 7.8, 256: 17.9}), _host({1: 8.0, 64: 6.1, 256: 10.2}))
    words, reasons = settings_words(tmp_path, 0.97)
    assert words == ["JVLLM_LAYERS_PER_CALL=8", "JVLLM_DISPATCH_THREAD=1"]
    assert "8 layers a call" in reasons[0] and "256 requests" in reasons[1]


def test_a_variant_within_the_margin_keeps_the_defaults(tmp_path):
    _write(tmp_path, _dispatch({"one layer a call": (5.5, 6.9), "no command buffers": (5.4, 6.8)}),
           _host({1: 8.6, 64: 7.8}), _host({1: 8.5, 64: 7.7}))
    assert settings_words(tmp_path, 0.97)[0] == []
    assert settings_words(tmp_path, 0.99)[0] == [f"XLA_FLAGS={NO_COMMAND_BUFFERS}", "JVLLM_DISPATCH_THREAD=1"]


def test_missing_or_failed_measurements_keep_the_defaults(tmp_path, capsys):
    assert settings_words(tmp_path, 0.97)[0] == []  # nothing measured
    _write(tmp_path, _dispatch({"one layer a call": None, "graphs of any size": (1.0, 1.0)}), _host({64: 7.8}))
    assert settings_words(tmp_path, 0.97)[0] == []  # the default failed: nothing to compare with; no threaded run
    assert main([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out == "\n" and "default way was not measured" in err and "dispatch thread" in err


def test_every_variant_passes_through_env_as_single_words():
    assert all(" " not in value for settings in VARIANTS.values() for value in settings.values())
    assert ANY_SIZE_GRAPHS.startswith("--xla_")
