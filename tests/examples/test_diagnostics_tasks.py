"""The diagnostic tasks' data (NumPy only): what each token holds, what the target is, and
the answer sources behind the window ceilings.

Map building and occlusion follow the authors' formats, so these tests pin the
formats down: the glimpse token, the unglimpsed cells a perfect memory can
only guess, the authors' occlusion whose final frame is on screen, and the
harder occlusion's per-frame targets and clock.
"""

from __future__ import annotations

import numpy as np
import pytest

from examples.diagnostics.tasks import MapBuilding, Occlusion, OcclusionFinalFrame


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# -- map building ----------------------------------------------------------------------------
def _decode_map(task: MapBuilding, batch, b: int) -> tuple[dict, tuple[int, int], int]:
    """Rebuild what example ``b``'s glimpses show: ``{(row, col): bit}``, the query cell and
    its answer."""
    G, P = task.grid, task.patch
    x = batch.inputs[b]
    seen: dict = {}
    for token in x[:-task.n_queries]:
        r0, c0 = np.rint(token[P * P: P * P + 2] * G).astype(int)
        assert token[P * P + 2] == 0.0  # observation marker
        for i, bit in enumerate(token[: P * P]):
            seen[(r0 + i // P, c0 + i % P)] = int(bit)
    q = x[-1]
    assert q[P * P + 2] == 1.0 and not q[: P * P].any()  # query marker, no glimpse bits
    cell = tuple(np.rint(q[P * P: P * P + 2] * G).astype(int))
    return seen, cell, int(batch.targets[b, -1])


def test_map_glimpses_are_consistent_with_one_hidden_grid():
    """Every glimpse of a cell shows the same bit, and a glimpsed query's answer is that bit."""
    task = MapBuilding(horizons=(32,))
    batch = task.batch(_rng(), 64, {"steps": 32})
    assert batch.inputs.shape == (64, 33, 7)
    assert batch.mask[:, -1].all() and not batch.mask[:, :-1].any()
    checked = 0
    for b in range(64):
        x = batch.inputs[b]
        bits: dict = {}
        for token in x[:-1]:
            r0, c0 = np.rint(token[4:6] * 8).astype(int)
            for i, bit in enumerate(token[:4]):
                assert bits.setdefault((r0 + i // 2, c0 + i % 2), bit) == bit
        seen, cell, answer = _decode_map(task, batch, b)
        if cell in seen:
            assert seen[cell] == answer
            checked += 1
    assert checked > 40


def test_map_source_is_the_last_glimpse_of_the_cell_or_minus_one():
    task = MapBuilding(horizons=(16,))
    batch = task.batch(_rng(1), 200, {"steps": 16})
    for b in range(200):
        corners = np.rint(batch.inputs[b, :16, 4:6] * 8).astype(int)
        _, (qr, qc), _ = _decode_map(task, batch, b)
        covering = [t for t, (r, c) in enumerate(corners) if r <= qr < r + 2 and c <= qc < c + 2]
        assert batch.source[b, -1] == (covering[-1] if covering else -1)


def test_map_queries_cover_the_whole_grid_and_some_are_never_glimpsed():
    """The authors' query: any cell of the grid, glimpsed or not."""
    task = MapBuilding(horizons=(16,))
    batch = task.batch(_rng(2), 4000, {"steps": 16})
    cells = {tuple(np.rint(q * 8).astype(int)) for q in batch.inputs[:, -1, 4:6]}
    assert len(cells) == 64
    observed = (batch.source[:, -1] >= 0).mean()
    assert abs(observed - task.observed_fraction(16)) < 0.03
    assert 0.5 < task.observed_fraction(16) < task.observed_fraction(64) < 1.0


def test_map_ceiling_in_one_window_is_the_guessing_limit():
    """In one window the ceiling is below 100: unglimpsed cells are a coin flip."""
    task = MapBuilding()
    for steps in (16, 64):
        expected = task.observed_fraction(steps) + (1 - task.observed_fraction(steps)) / 2
        assert abs(task.window_ceiling({"steps": steps}, None) - expected) < 0.02
    # in segments of 8, older glimpses are out of sight: lower still
    assert task.window_ceiling({"steps": 64}, 8) < task.window_ceiling({"steps": 64}, None) - 0.2


def test_map_rejects_a_patch_larger_than_the_grid():
    with pytest.raises(ValueError, match="patch"):
        MapBuilding(grid=4, patch=5)


# -- the authors' occlusion --------------------------------------------------------------------
def _frames(task: OcclusionFinalFrame, x: np.ndarray) -> np.ndarray:
    """Patch tokens ``(N, P*P)`` back to frames ``(T, S, S)``."""
    S, P, n = task.frame_size, task.patch, task.frame_size // task.patch
    return (x.reshape(task.frames, n, n, P, P).transpose(0, 1, 3, 2, 4)
            .reshape(task.frames, S, S))


@pytest.mark.parametrize("hidden", [0, 2, 6])
def test_authors_occlusion_hides_the_middle_frames_and_shows_the_final_one(hidden):
    task = OcclusionFinalFrame()
    batch = task.batch(_rng(3), 32, {"occluded": hidden})
    assert batch.inputs.shape == (32, 128, 16)
    start = (8 - hidden) // 2
    for b in range(32):
        frames = _frames(task, batch.inputs[b])
        ball = frames.reshape(8, -1).sum(-1)
        hidden_frames = set(range(start, start + hidden))
        for t in range(8):
            assert ball[t] == (0.0 if t in hidden_frames else 4.0)  # a 2x2 ball, or nothing
        # the target is the quadrant of the ball's top-left pixel in the FINAL frame
        rows, cols = np.nonzero(frames[-1])
        top = rows.min() if rows.max() - rows.min() == 1 else rows.max()  # wrapped ball
        left = cols.min() if cols.max() - cols.min() == 1 else cols.max()
        assert batch.targets[b, -1] == 2 * (top >= 8) + (left >= 8)
    assert batch.mask[:, -1].all() and batch.mask.sum() == 32
    assert task.window_ceiling({"occluded": hidden}, None) == 1.0


def test_authors_occlusion_ball_moves_at_constant_velocity_with_wrapping():
    task = OcclusionFinalFrame()
    batch = task.batch(_rng(4), 16, {"occluded": 0})
    for b in range(16):
        frames = _frames(task, batch.inputs[b])
        shifts = set()
        for t in range(7):
            for dr in (-1, 0, 1):
                for dc in (-1, 0, 1):
                    if np.array_equal(np.roll(frames[t], (dr, dc), axis=(0, 1)), frames[t + 1]):
                        shifts.add((t, dr, dc))
        moves = {(dr, dc) for _, dr, dc in shifts}
        assert len(moves) == 1 and moves != {(0, 0)}
        assert {t for t, _, _ in shifts} == set(range(7))


def test_authors_occlusion_checks_its_sizes():
    with pytest.raises(ValueError, match="patch"):
        OcclusionFinalFrame(frame_size=16, patch=5)
    with pytest.raises(ValueError, match="lengths"):
        OcclusionFinalFrame(lengths=(8,), frames=8)


# -- the harder occlusion --------------------------------------------------------------------
def test_harder_occlusion_targets_every_hidden_frame():
    task = Occlusion()
    batch = task.batch(_rng(5), 64, {"occluded": 8})
    F = task.frame
    assert batch.inputs.shape == (64, 12, F * F + 3)
    assert not batch.mask[:, :4].any() and batch.mask[:, 4:].all()
    assert np.all(batch.inputs[:, 4:, : F * F] == 0.5)  # the occluder covers the view
    assert np.all(batch.inputs[:, :4, F * F] == 1.0) and np.all(batch.inputs[:, 4:, F * F + 1] == 1)
    # the hidden targets follow the straight line through the visible frames: extrapolate
    # the blob's centre from frames 0 and 3 (constant speed) and compare quadrants where
    # the line is clear of the centre lines
    grid = np.arange(F)
    frames = batch.inputs[:, :4, : F * F].reshape(64, 4, F, F)
    weight = frames.sum((-1, -2))
    centre = np.stack([(frames.sum(-1) * grid).sum(-1), (frames.sum(-2) * grid).sum(-1)],
                      -1) / weight[..., None]  # (B, 4, [row, col])
    t = np.arange(12)[None, :, None]
    line = centre[:, :1] + (centre[:, 3:4] - centre[:, :1]) * t / 3  # (B, 12, 2)
    expected = 2 * (line[..., 0] > 3.5) + (line[..., 1] > 3.5)
    clear = (np.abs(line - 3.5) > 0.6).all(-1)
    clear[:, :4] = False
    assert clear.sum() > 200
    assert (expected[clear] == batch.targets[clear]).mean() > 0.97


def test_harder_occlusion_clock_is_the_only_difference():
    plain, clocked = Occlusion(), Occlusion(clock=True)
    a = plain.batch(_rng(6), 8, {"occluded": 16})
    b = clocked.batch(_rng(6), 8, {"occluded": 16})
    F = plain.frame
    assert np.array_equal(a.inputs[..., :-1], b.inputs[..., :-1])
    assert np.array_equal(a.targets, b.targets) and np.array_equal(a.mask, b.mask)
    assert not a.inputs[..., -1].any()
    assert np.allclose(b.inputs[0, :, F * F + 2], np.arange(20) / 32)


def test_harder_occlusion_ceiling_in_segments_of_8():
    """4 visible + L hidden frames, left-padded into segments of 8: up to L = 4 the whole
    stream is one segment; from L = 8 on, no hidden frame shares a segment with the
    visible ones, so a model without state can only guess (25 %)."""
    task = Occlusion()
    assert task.window_ceiling({"occluded": 4}, 8) == 1.0
    assert task.window_ceiling({"occluded": 8}, 8) == pytest.approx(0.25)
    assert task.window_ceiling({"occluded": 16}, 8) == pytest.approx(0.25)


def test_harder_occlusion_reference_holds_the_last_seen_quadrant():
    """The rule 'the ball stays in the quadrant it was last seen in' is right more often
    after short occlusions; it is the score of a memory that keeps position only."""
    task = Occlusion()
    short, long = (task.references({"occluded": n})["last seen quadrant"] for n in (2, 16))
    assert 0.7 < short < 0.85 and 0.5 < long < 0.62
    assert MapBuilding().references({"steps": 16}) == {}


def test_reference_rules_are_rendered_under_the_table():
    pytest.importorskip("matplotlib", reason="the report needs matplotlib")
    pytest.importorskip("rich", reason="the report needs rich")
    from examples.diagnostics.report import table

    result = {"settings": ["L=8"], "rows": [{"model": "tensor_memory", "setting": "L=8",
                                             "seeds": [50.0, 60.0], "reset": [25.0, 25.0]}],
              "params": {"tensor_memory": 1}, "carried": {"tensor_memory": 2},
              "window_ceiling": {"L=8": 25.0}, "config": {"reset": "segment"},
              "references": {"last seen quadrant": {"L=8": 56.1}}}
    _, rows = table(result)
    assert ["last seen quadrant (a rule, no model)", "", "", "56.1", "", ""] in rows


def test_fixed_to_and_with_options_copy_the_task():
    task = Occlusion()
    one = task.fixed_to({"occluded": 8})
    assert one.eval_settings == [{"occluded": 8}] and task.eval_settings != one.eval_settings
    assert all(one.train_setting(_rng(s)) == {"occluded": 8} for s in range(5))
    assert task.fixed is None
    clocked = task.with_options(clock=True)
    assert clocked.clock and not task.clock
    with pytest.raises(ValueError, match="no option 'clok'"):
        task.with_options(clok=True)


# -- which hyper-parameters a row uses --------------------------------------------------------
def test_row_hparams_by_label_then_kind():
    pytest.importorskip("torch", reason="the runner needs PyTorch")
    from examples.diagnostics.runner import Entry, row_hparams

    chosen = {"tensor_memory": {"lr": 0.003, "forget_bias": 3.0},
              "memory_slots +clock": {"lr": 0.001}, "memory_slots": {"lr": 0.006}}
    assert row_hparams(chosen, Entry("tensor_memory +clock", "tensor_memory",
                                     task_options={"clock": True})) == chosen["tensor_memory"]
    assert row_hparams(chosen, Entry("memory_slots +clock", "memory_slots")) == {"lr": 0.001}
    assert row_hparams(chosen, Entry("transformer", "transformer")) == {}


def test_streaming_tasks_fall_back_to_the_binding_tuning_file(tmp_path, monkeypatch):
    """A streaming task without its own tuning file uses the task its experiment names
    (``tuning_from``); its own file, once there, wins."""
    pytest.importorskip("torch", reason="the runner needs PyTorch")
    import json

    from examples.diagnostics import __main__ as cli
    from examples.diagnostics.runner import make_experiment

    monkeypatch.setattr(cli, "RESULTS_DIR", tmp_path)
    (tmp_path / "binding-streaming-tuning.json").write_text(
        json.dumps({"chosen": {"tensor_memory": {"lr": 0.003}}}))
    args = cli.parse_args(["mapping"])
    exp = make_experiment("mapping", protocol="streaming")
    assert exp.tuning_from == "binding"
    chosen, source = cli._hparams(args, "mapping", "streaming", exp.tuning_from)
    assert chosen == {"tensor_memory": {"lr": 0.003}}
    assert source.endswith("binding-streaming-tuning.json")
    (tmp_path / "mapping-streaming-tuning.json").write_text(
        json.dumps({"chosen": {"tensor_memory": {"lr": 0.001}}}))
    chosen, source = cli._hparams(args, "mapping", "streaming", exp.tuning_from)
    assert chosen == {"tensor_memory": {"lr": 0.001}}
    assert cli._hparams(args, "mapping", "paper", exp.tuning_from) == ({}, None)
