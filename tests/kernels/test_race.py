"""The compiled keyed race (vispec.kernels.race) is bit-identical to the eager composition.

The specification is ``sample_from_weights(w, E)`` with ``E`` from :func:`vispec.kernels.philox.exponentials`
keyed per row; every test compares against it with ``torch.equal`` (exact values, exact indices).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vispec.kernels import race
from vispec.kernels.philox import Stream, exponentials, uniform_from_words, vocab_words
from vispec.kernels.verify import race_argmax, sample_from_weights

ROWS = (1, 3, 40)
VOCABS = (1, 5, 1024, 16384 + 3)


def _keys(rows: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Seeds over all 64 bits, positions and draws beyond 32 bits (counters are taken mod 2**32)."""
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen)
    positions = torch.randint(0, 2**34, (rows,), generator=gen)
    streams = torch.randint(1, 9, (rows,), generator=gen)
    draws = torch.randint(0, 2**33, (rows,), generator=gen)
    return seeds, positions, streams, draws


def _per_row_exponentials(keys: tuple[torch.Tensor, ...], vocab: int) -> torch.Tensor:
    seeds, positions, streams, draws = keys
    return torch.stack([exponentials(seeds[r : r + 1], positions[r].view(1, 1), streams[r], draws[r].view(1), vocab)[0, 0]
                        for r in range(seeds.shape[0])])


def _weights(rows: int, vocab: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(rows, vocab, generator=gen, dtype=torch.float64) ** 4
    w[torch.rand(rows, vocab, generator=gen) < 0.3] = 0.0  # zero weights must never win
    return w.to(dtype)


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    """These are the tests of the fused path: on here, whatever the environment says (``tests/conftest.py``
    sets ``VISPEC_FUSED_NOISE=0`` for every other test and the processes they start)."""
    monkeypatch.setattr(race, "_failed", False)
    with race.fused(True):
        yield


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_bit_identical_to_eager(rows, vocab):
    keys = _keys(rows, seed=rows * 7 + vocab)
    ref_noise = _per_row_exponentials(keys, vocab)
    assert torch.equal(race.eager_exponentials(*keys, vocab), ref_noise)
    assert torch.equal(race.keyed_exponentials(*keys, vocab), ref_noise)
    for dtype in (torch.float32, torch.float64):
        weights = _weights(rows, vocab, dtype, seed=vocab)
        expected = sample_from_weights(weights, ref_noise)
        got = race.keyed_race(weights, *keys)
        assert got.dtype == torch.int64 and got.shape == (rows,)
        assert torch.equal(got, expected)
        assert torch.equal(got, race_argmax(weights, ref_noise))
        positive = (weights > 0).any(-1)
        assert bool((weights.gather(1, got[:, None])[:, 0] > 0)[positive].all())  # zero weights never win
    assert race.fused_enabled()  # the compiled path ran (a failure would have switched it off)


def test_batched_eager_matches_the_per_row_definition():
    keys = _keys(5, seed=3)
    expected = _per_row_exponentials(keys, 37)
    assert torch.equal(race.eager_exponentials(*keys, 37), expected)
    assert torch.equal(race.keyed_exponentials(*keys, 37), expected)


def test_scalar_stream_and_extreme_keys():
    seeds = torch.tensor([-(2**63), -1, 0, 2**63 - 1, 2**32 - 1, 2**32])
    positions = torch.tensor([0, 2**32 - 1, 2**32, 2**63 - 1, -1, 7])
    draws = torch.tensor([2**32 - 1, 0, -(2**63), 5, 2**40 + 1, 3])
    for stream in (Stream.RESIDUAL, Stream.SAMPLE):
        expected = race.eager_exponentials(seeds, positions, int(stream), draws, 1027)
        assert torch.equal(race.keyed_exponentials(seeds, positions, stream, draws, 1027), expected)
        assert torch.equal(race.keyed_exponentials(seeds, positions, torch.full((6,), int(stream)), draws, 1027), expected)


def test_uniform_blocks_exact_uncompiled():
    """The traced function is exact as plain PyTorch too (what dynamo runs if it ever gives up compiling)."""
    seeds, positions, streams, draws = _keys(4, seed=9)
    words = vocab_words(seeds, positions[:, None], streams[:, None], draws[:, None], 4 * 33)[:, 0]
    u = race._uniform_blocks(torch.stack((seeds, positions, streams, draws)), 33)
    assert torch.equal(u.transpose(1, 2).reshape(4, -1), uniform_from_words(words))


def test_ties_first_index_wins():
    rows, vocab = 3, 1024
    keys = _keys(rows, seed=5)
    noise = race.eager_exponentials(*keys, vocab)
    weights = noise * 2.0  # exact: every score is exactly 2, all tied
    weights[1, :17] = 0.0
    weights[2, 1000:] = 4 * noise[2, 1000:]  # a tied block of higher scores
    expected = race_argmax(weights, noise)
    assert expected.tolist() == [0, 17, 1000]
    assert torch.equal(race.keyed_race(weights, *keys), expected)
    assert torch.equal(race.keyed_race(weights.double(), *keys), expected)


def test_zero_rows_and_special_values():
    rows, vocab = 8, 333
    keys = _keys(rows, seed=6)
    noise = race.eager_exponentials(*keys, vocab)
    weights = _weights(rows, vocab, torch.float32)
    weights[0] = 0.0  # all zero: index 0
    weights[1] = -0.0
    weights[2, 50] = float("nan")
    weights[2, 7] = float("nan")
    weights[3, 100:] = float("inf")
    weights[4] = float("-inf")
    weights[5] = -weights[5]  # negative weights: the race still follows argmax
    weights[6, 3] = 1e-45  # a lone subnormal weight
    weights[6, :3] = 0.0
    weights[6, 4:] = 0.0
    for w in (weights, weights.double(), weights.half()):
        expected = sample_from_weights(w, noise)
        assert torch.equal(race.keyed_race(w, *keys), expected)
    assert race.keyed_race(weights, *keys)[:4].tolist() == [0, 0, 7, 100]


@pytest.mark.parametrize("vocab", (17, 4099))
def test_random_special_values(vocab):
    """NaN (first one wins), ±inf, ±0, negatives and subnormals sprinkled anywhere, including across
    the vector widths of the reductions: argmin of ``w / log u`` is argmax of ``w / E`` on all of them."""
    rows = 40
    keys = _keys(rows, seed=vocab)
    noise = race.eager_exponentials(*keys, vocab)
    gen = torch.Generator().manual_seed(vocab)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1.0, 1e-45, 1e-40, 3.0e38])
    for density in (0.0005, 0.01, 0.3):
        weights = _weights(rows, vocab, torch.float32, seed=int(density * 1e4))
        where = torch.rand(rows, vocab, generator=gen) < density
        weights[where] = specials[torch.randint(0, len(specials), (int(where.sum()),), generator=gen)]
        for w in (weights, weights.double()):
            assert torch.equal(race.keyed_race(w, *keys), sample_from_weights(w, noise))


def test_layouts_modes_and_dtypes():
    rows, vocab = 6, 1030
    keys = _keys(rows, seed=8)
    noise = race.eager_exponentials(*keys, vocab)
    base = _weights(rows, 2 * vocab, torch.float32)
    strided = base[:, ::2]  # a non-contiguous view
    transposed = base[:, :vocab].t().contiguous().t()
    for w in (strided, transposed, base[:, :vocab].requires_grad_(), base[:, :vocab].bfloat16()):
        assert torch.equal(race.keyed_race(w, *keys), sample_from_weights(w.detach(), noise))
    with torch.inference_mode():
        w = base[:, :vocab].clone()
        assert torch.equal(race.keyed_race(w, *keys), sample_from_weights(w, noise))
        assert torch.equal(race.keyed_exponentials(*keys, vocab), noise)
    with torch.no_grad():
        assert torch.equal(race.keyed_race(strided, *keys), sample_from_weights(strided, noise))


def test_exponentials_exhaustive_over_the_uniform_grid():
    """``-log u`` of the fused path equals eager ``-torch.log(u)`` for all 2**23 values ``u = (k + 1/2) / 2**23``
    (the whole image of ``uniform_from_words``), laid out as the compiled kernel writes them."""
    k = torch.arange(2**23, dtype=torch.int64)
    grid = uniform_from_words(k << 9)
    assert torch.equal(grid, (k.double() + 0.5).div(2**23).float())
    expected = -torch.log(grid)
    blocks = grid.view(1, 2**21, 4).transpose(1, 2).contiguous()  # u[0, v % 4, v // 4], as _uniform_blocks
    got = race._log_in_vocab_order(blocks, 1, 2**23).neg()[0]
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_switch_and_env_var_force_eager(monkeypatch):
    keys = _keys(3, seed=11)
    weights = _weights(3, 100, torch.float32)
    expected = sample_from_weights(weights, race.eager_exponentials(*keys, 100))

    def boom():
        raise AssertionError("compiled path used while switched off")

    with race.fused(False):
        assert not race.fused_enabled()
        monkeypatch.setattr(race, "_compiled_uniforms", boom)
        assert torch.equal(race.keyed_race(weights, *keys), expected)
    assert race.fused_enabled()  # the fixture's setting is back


def test_env_var_is_read_when_noise_is_drawn(monkeypatch):
    """No import-time state: ``VISPEC_FUSED_NOISE`` decides at each call unless ``set_fused`` forced a path;
    unset, :data:`race.DEFAULT` decides; a bad value is a ValueError naming the variable."""
    with race.fused(None):
        for value, shown in (("0", False), ("off", False), ("1", True), ("Yes", True)):
            monkeypatch.setenv(race.ENV_VAR, value)
            assert race.fused_enabled() is shown
        monkeypatch.delenv(race.ENV_VAR)
        assert race.fused_enabled() is race.DEFAULT
        monkeypatch.setenv(race.ENV_VAR, "maybe")
        with pytest.raises(ValueError, match=race.ENV_VAR):
            race.fused_enabled()
        monkeypatch.setenv(race.ENV_VAR, "0")
        race.set_fused(True)
        assert race.fused_enabled()  # forced beats the environment
    with pytest.raises(ValueError, match="enabled must be True, False or None"):
        race.set_fused(1)


def test_test_processes_default_to_eager():
    """``tests/conftest.py`` puts ``VISPEC_FUSED_NOISE=0`` in the environment (unless the run set it), so every
    test but these, and every process a test starts, draws eager noise and compiles nothing."""
    code = "from vispec.kernels import race; print(race.fused_enabled())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(os.environ[race.ENV_VAR] not in ("0", "false", "off", "no"))


def test_compile_failure_warns_once_and_falls_back(monkeypatch):
    keys = _keys(2, seed=12)
    weights = _weights(2, 64, torch.float32)
    expected = sample_from_weights(weights, race.eager_exponentials(*keys, 64))

    def no_compiler():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(race, "_compiled_uniforms", no_compiler)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert torch.equal(race.keyed_race(weights, *keys), expected)
    assert not race.fused_enabled()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(race.keyed_race(weights, *keys), expected)


def test_bad_keys_raise_without_disabling():
    keys = list(_keys(3))
    keys[1] = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="one value per row"):
        race.keyed_race(torch.ones(3, 10), *keys)
    assert race.fused_enabled()


@pytest.mark.parametrize("change", ["stream", "draw", "seed"])
def test_negative_control_identity_check_detects_other_noise(change):
    """The equality tests are not vacuous: noise one counter away gives other tokens."""
    rows, vocab = 40, 1024
    seeds, positions, streams, draws = _keys(rows, seed=13)
    weights = torch.ones(rows, vocab)
    expected = sample_from_weights(weights, race.eager_exponentials(seeds, positions, streams, draws, vocab))
    if change == "stream":
        streams = streams % 8 + 1
    elif change == "draw":
        draws = draws + 1
    else:
        seeds = seeds ^ 1
    got = race.keyed_race(weights, seeds, positions, streams, draws)
    assert not torch.equal(got, expected)
    assert (got != expected).float().mean() > 0.9


def test_keyed_uniforms_match_acceptance_uniforms():
    from vispec.kernels.philox import uniforms

    for rows in (1, 7):
        seeds, positions, _, draws = _keys(rows, seed=14)
        expected = uniforms(seeds, positions[:, None], Stream.ACCEPT, draws)[:, 0]
        assert torch.equal(race.keyed_uniforms(seeds, positions, Stream.ACCEPT, draws), expected)
    assert race.fused_enabled()


def test_one_graph_serves_every_shape():
    """After the first (lazy) compile, new row counts and vocabularies reuse the graph: no recompilation."""
    from torch._dynamo.utils import counters

    race.keyed_race(torch.ones(3, 50), *_keys(3))
    before = counters["stats"]["unique_graphs"]
    for rows, vocab in ((1, 2), (2, 8), (5, 5), (9, 4097), (2, 3), (64, 7)):
        keys = _keys(rows, seed=rows + vocab)
        weights = _weights(rows, vocab, torch.float32)
        assert torch.equal(race.keyed_race(weights, *keys), sample_from_weights(weights, race.eager_exponentials(*keys, vocab)))
    assert counters["stats"]["unique_graphs"] == before
    assert race.fused_enabled()


@pytest.mark.parametrize("rows,vocab", [(1, 1024), (6, 16384 + 3)])
def test_race_inside_a_compiled_graph_is_bit_identical(rows, vocab):
    """Compiled decode steps trace the Philox words into their graph (static shapes, as the steps compile) and run
    only ``log`` and the race eagerly (``vispec::race_uniforms``): the uniforms and the tokens are the eager ones,
    for extreme keys and both weight dtypes."""
    from vispec.kernels.philox import uniforms

    seeds, positions, streams, draws = _keys(rows, seed=rows + vocab)
    seeds[0] = -(2**63)  # every bit of both key words
    words = torch.compile(lambda *k: race.graph_uniforms(torch.stack(k), vocab), dynamic=False, fullgraph=True)
    assert torch.equal(words(seeds, positions, streams, draws),
                       uniforms(seeds, positions[:, None], streams[:, None], draws, vocab_size=vocab)[:, 0])
    sample = torch.compile(race.race, dynamic=False, fullgraph=True)
    for dtype in (torch.float32, torch.float64):
        weights = _weights(rows, vocab, dtype, seed=vocab)
        expected = sample_from_weights(weights, race.eager_exponentials(seeds, positions, streams, draws, vocab))
        with torch.profiler.profile() as prof:
            got = sample(weights, seeds, positions, streams, draws)
        assert torch.equal(got, expected)
        ran = {e.name for e in prof.events()}
        assert "vispec::race_uniforms" in ran and "vispec::keyed_race" not in ran  # the in-graph path ran


@pytest.mark.parametrize("rows,count", [(1, 3), (7, 1024 + 1)])
def test_step_noise_inside_a_compiled_graph_is_bit_identical(rows, count):
    """The acceptance uniforms, the rank words and the sibling / residual exponentials a compiled step draws
    (``uniforms_for``, ``words_for``, ``exponentials_for``) trace their Philox words into the graph; only the
    exponentials' ``log`` runs eagerly (``vispec::neg_log``). Each gives the eager bits, for extreme keys."""
    seeds, positions, streams, draws = _keys(rows, seed=rows + count)
    seeds[0] = -(2**63)
    keys = (seeds, positions, streams, draws)
    cases = {
        "uniforms": (lambda *k: race.uniforms_for(*k), race.keyed_uniforms(*keys)),
        "words": (lambda *k: race.words_for(*k, count), race.words_for(*keys, count)),
        "exponentials": (lambda *k: race.exponentials_for(*k, count), race.eager_exponentials(*keys, count)),
    }
    for name, (fn, expected) in cases.items():
        with torch.profiler.profile() as prof:
            got = torch.compile(fn, dynamic=False, fullgraph=True)(*keys)
        assert torch.equal(got, expected), name
        ran = {e.name for e in prof.events()}
        assert not any(op in ran for op in ("vispec::keyed_exponentials", "vispec::keyed_words", "vispec::keyed_uniforms")), name
        assert ("vispec::neg_log" in ran) == (name == "exponentials"), name
