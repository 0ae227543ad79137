"""The delay pattern and sampling rules of MODEL.md, tested directly (no model)."""

import numpy as np
import pytest

from higgs_pack.errors import InputError
from higgs_pack.runtime.loop.delay import Sampler, apply_delay, undo_delay
from higgs_pack.runtime.options import SamplingOptions, bundle_sampling

BOC, EOC, N = 1024, 1025, 8


def test_apply_delay_shifts_codebook_c_by_c_frames():
    codes = np.arange(5 * N).reshape(5, N) % 1000
    delayed = apply_delay(codes, BOC, EOC)
    assert delayed.shape == (5 + N - 1, N)
    for c in range(N):
        assert (delayed[:c, c] == BOC).all()
        assert (delayed[c : c + 5, c] == codes[:, c]).all()
        assert (delayed[c + 5 :, c] == EOC).all()


def test_undo_delay_inverts_apply_delay():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 1024, size=(13, N))
    assert np.array_equal(undo_delay(apply_delay(codes, BOC, EOC), 1024), codes)


def test_undo_delay_of_a_short_run_is_empty():
    assert undo_delay(np.full((3, N), BOC), 1024).shape == (0, N)


def _allowed():
    allowed = np.zeros((N, 1026), dtype=bool)
    allowed[:, :1024] = True
    return allowed


def sample_codes(logits, allowed, options, rng):
    """One frame drawn by a new :class:`Sampler` (the loop keeps one per request)."""
    return Sampler(allowed, options).draw(logits, rng).copy()


def test_greedy_is_argmax_and_never_picks_forbidden_codes():
    logits = np.zeros((N, 1026), dtype=np.float32)
    logits[:, 1024] = 100.0  # BOC is never allowed to be sampled
    logits[np.arange(N), np.arange(N) * 3] = 5.0
    out = sample_codes(logits, _allowed(), SamplingOptions(temperature=0), np.random.default_rng(0))
    assert out.tolist() == [c * 3 for c in range(N)]


def test_top_k_one_equals_greedy_and_seed_repeats():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(N, 1026)).astype(np.float32)
    greedy = sample_codes(logits, _allowed(), SamplingOptions(temperature=0), np.random.default_rng(0))
    top1 = sample_codes(logits, _allowed(), SamplingOptions(temperature=0.8, top_k=1), np.random.default_rng(0))
    assert np.array_equal(greedy, top1)
    a = sample_codes(logits, _allowed(), SamplingOptions(), np.random.default_rng(7))
    b = sample_codes(logits, _allowed(), SamplingOptions(), np.random.default_rng(7))
    assert np.array_equal(a, b)


def test_top_p_keeps_only_the_nucleus():
    logits = np.full((N, 1026), -50.0, dtype=np.float32)
    logits[:, 10] = 10.0  # ~all the mass
    logits[:, 11] = 9.0
    rng = np.random.default_rng(0)
    draws = {int(sample_codes(logits, _allowed(), SamplingOptions(top_k=0, top_p=0.5), rng)[0]) for _ in range(50)}
    assert draws == {10}


def test_sampling_follows_the_distribution():
    logits = np.full((N, 1026), -np.inf, dtype=np.float32)
    logits[:, 0] = np.log(0.25)
    logits[:, 1] = np.log(0.75)
    rng = np.random.default_rng(0)
    draws = np.stack([sample_codes(logits, _allowed(), SamplingOptions(temperature=1, top_k=0), rng)
                      for _ in range(400)])
    assert 0.68 < (draws == 1).mean() < 0.82


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0}, "top_p"),
    ({"repeat_guard_frames": -1}, "repeat_guard_frames"),
])
def test_bad_sampling_options_name_the_option(kwargs, message):
    from higgs_pack.errors import InputError

    with pytest.raises(InputError, match=message) as caught:
        SamplingOptions(**kwargs)  # checked once, when made
    assert [p.field for p in caught.value.problems] == [message]


def test_every_bad_option_is_named_once():
    from higgs_pack.runtime.options import sampling_problems

    problems = sampling_problems({"temperature": "hot", "top_k": -2, "top_p": 0, "seed": 1.5})
    assert [p.render() for p in problems] == [
        "seed must be a whole number, got 1.5", "temperature must be a number, got 'hot'",
        "top_k must be >= 0 (0 = off), got -2", "top_p must be in (0, 1], got 0"]
    assert [(p.field, p.value) for p in problems] == [("seed", 1.5), ("temperature", "hot"), ("top_k", -2),
                                                      ("top_p", 0)]
    assert sampling_problems({}) == [] and sampling_problems(vars(SamplingOptions())) == []


def test_bundle_defaults_fill_what_the_caller_left_unset():
    defaults = {"sampling": {"temperature": 0.7, "top_k": 30, "repeat_guard_frames": 20}}
    options = bundle_sampling(defaults, top_k=5, seed=None)
    assert (options.temperature, options.top_k, options.top_p, options.seed, options.repeat_guard_frames) \
        == (0.7, 5, 1.0, None, 20)
    assert bundle_sampling({}) == SamplingOptions()
    with pytest.raises(InputError, match="top_p must be in"):
        bundle_sampling(defaults, top_p=2.0)


def test_kept_codes_path_draws_what_the_dense_path_draws(monkeypatch):
    """The default options sample on the [N, k] kept codes; frames with ties at the k-th
    largest logit, and a sampler made with the gather turned off, use all [N, V] codes.
    Both give the same codes for the same generator state."""
    from higgs_pack.runtime.loop import delay

    options = SamplingOptions(temperature=0.9, top_k=50)
    kept = delay.Sampler(_allowed(), options)
    monkeypatch.setattr(delay, "KEPT_CODES_MAX", 0)
    dense = delay.Sampler(_allowed(), options)
    g = np.random.default_rng(2)
    rng_kept, rng_dense = np.random.default_rng(9), np.random.default_rng(9)
    for i in range(400):
        logits = (g.standard_normal((N, 1026)) * (1 + i % 4)).astype(np.float32)
        if i % 5 == 0:
            logits = np.round(logits, 1)  # ties at the threshold
        if i % 9 == 0:
            logits[:, 300:400] = logits.max()  # more than k codes tied for the top
        a, b = kept.draw(logits, rng_kept).copy(), dense.draw(logits, rng_dense).copy()
        assert np.array_equal(a, b), f"frame {i}: {a} != {b}"
        assert (a < 1024).all()
