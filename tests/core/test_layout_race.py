"""``cltrain.timing.layout_race.LayoutRace``: the schedule and the rule that decides from the run's own step times."""

from __future__ import annotations

import json
import random

import pytest

from cltrain.timing.layout_race import LayoutDecision, LayoutRace
from cltrain.timing.stats import log_ratio, paired_log_ratio

KEY = ((3, 224, 224), "bf16", "cpu")


def run(race: LayoutRace, seconds, key=KEY, batch: int = 32, steps: int = 3 + 4 * 24) -> tuple[LayoutDecision | None, list]:
    """Feed ``race`` steps whose time is ``seconds(layout, step)`` until it decides; the layouts it asked for."""
    layouts = []
    for step in range(steps):
        layout = race.next_layout(key)
        layouts.append(layout)
        race.record(key, batch, layout, seconds(layout, step))
        if race.due():
            decision = race.judge()
            if decision is not None:
                return race.settle(decision), layouts
    return None, layouts


def test_the_schedule_warms_up_then_alternates_in_rounds_and_a_clear_winner_ends_it_after_one() -> None:
    decision, layouts = run(LayoutRace(warmup=3), lambda layout, step: {"channels_last": 1.0, "contiguous": 1.45}[layout])
    assert layouts == ["channels_last"] * 5 + ["contiguous"] * 2
    assert decision.layout == "channels_last" and decision.how == "timed" and decision.ratio == pytest.approx(1.45)
    # the first NCHW step warms its kernels up: not a sample; both NCHW steps count in the cost
    assert decision.samples == {"channels_last": 2, "contiguous": 1}
    assert decision.extra_seconds == pytest.approx(2 * 0.45)


def test_nchw_faster_beyond_the_margin_is_kept() -> None:
    decision, _ = run(LayoutRace(), lambda layout, step: {"channels_last": 1.12, "contiguous": 1.0}[layout])
    assert decision.layout == "contiguous" and decision.how == "timed"


def test_within_the_margin_is_a_tie_that_goes_to_channels_last() -> None:
    rng = random.Random(0)
    decision, _ = run(LayoutRace(), lambda layout, step: (1.0 if layout == "channels_last" else 0.995)
                      * (1 + rng.uniform(-0.001, 0.001)))
    assert decision.layout == "channels_last" and decision.how == "tie"


@pytest.mark.parametrize("seed", range(20))
def test_noise_on_a_shared_machine_never_flips_to_nchw(seed) -> None:
    """Equal layouts, each step 30% off at random (another process on the cores): the default stays."""
    rng = random.Random(seed)
    decision, layouts = run(LayoutRace(), lambda layout, step: rng.uniform(0.7, 1.3))
    assert decision is not None and decision.layout == "channels_last"
    assert len(layouts) <= 3 + 4 * 24  # the rounds are bounded


def test_a_small_real_gain_under_mild_noise_is_found() -> None:
    rng = random.Random(1)
    decision, _ = run(LayoutRace(), lambda layout, step: (1.0 if layout == "channels_last" else 0.95)
                      * rng.uniform(0.99, 1.01))
    assert decision.layout == "contiguous"


def test_a_machine_slowing_down_over_the_race_does_not_hide_a_lead() -> None:
    """Each step 1.5% slower than the last (a process starting beside the run), NCHW 6% faster: each NCHW step is
    compared with the channels_last steps on both sides of it."""
    def seconds(layout, step):
        return (0.94 if layout == "contiguous" else 1.0) * 1.015 ** step

    decision, layouts = run(LayoutRace(), seconds)
    assert decision.layout == "contiguous" and decision.how == "timed" and decision.samples["contiguous"] <= 9
    # negative controls: the same steps pooled cannot tell the layouts apart; paired within a round only, the NCHW
    # steps, two steps later, take the drift for the layout
    timed = [(i, layout, seconds(layout, i)) for i, layout in enumerate(layouts)][3:]
    pooled = log_ratio([t for _, la, t in timed if la == "channels_last"], [t for _, la, t in timed if la != "channels_last"])
    assert pooled.log + pooled.bound(0.99) > -0.02
    within = paired_log_ratio([((i - 3) // 4, t) for i, la, t in timed if la == "channels_last"],
                              [((i - 3) // 4, t) for i, la, t in timed if la != "channels_last"])
    assert within.log > -0.04  # a 6% lead read as under 4%


def test_the_budget_ends_a_race_whose_slower_steps_cost_a_step_of_the_faster() -> None:
    rng = random.Random(2)
    race = LayoutRace(budget=0.3)
    decision, layouts = run(race, lambda layout, step: (1.0 if layout == "channels_last" else 1.1)
                            * rng.uniform(0.8, 1.2))
    assert decision is not None and decision.layout == "channels_last"
    assert decision.extra_seconds <= 0.3 * 1.0 + 0.25  # within a round of the budget


@pytest.mark.parametrize("seed", [8, 97, 102])
def test_the_default_s_own_slower_steps_do_not_spend_the_budget(seed) -> None:
    """NCHW 1.3x faster under heavy noise: where the medians put NCHW ahead, its trials cost nothing, and the race
    goes on (the budget counted channels_last's excess and ended these in a few rounds: noisy, channels_last kept)."""
    rng = random.Random(seed)
    decision, layouts = run(LayoutRace(), lambda layout, step: (1.3 if layout == "channels_last" else 1.0)
                            * rng.uniform(0.5, 1.5))
    assert decision.layout == "contiguous" and len(layouts) > 3 + 4 * 5, (decision, len(layouts))


def test_a_smaller_last_batch_is_no_sample_and_other_kinds_of_batch_are_raced_apart() -> None:
    race = LayoutRace(warmup=1)
    other = ((3, 256, 256), "bf16", "cpu")
    for size, seconds in [(32, 9.0), (32, 1.0), (7, 0.1), (32, 9.0), (32, 1.2)]:  # the 9 s NCHW step warms up
        race.record(KEY, size, race.next_layout(KEY), seconds)
    assert race.due()
    decision = race.settle(race.judge())
    assert decision.samples == {"channels_last": 1, "contiguous": 1}  # the batch of 7 was not timed
    assert race.next_layout(KEY) == "channels_last" and race.next_layout(other) == "channels_last"
    assert race.racing() and other not in race.decisions  # progressive resizing: decided again


def test_rounds_without_both_layouts_are_no_pair_and_the_race_goes_on() -> None:
    race = LayoutRace(warmup=0)
    # round 0: channels_last timed, NCHW's warm-up and a smaller batch; round 1: channels_last on smaller batches
    for size, seconds in [(32, 1.0), (32, 1.0), (32, 9.0), (7, 0.3), (7, 0.3), (7, 0.3), (32, 0.8), (32, 0.8)]:
        race.record(KEY, size, race.next_layout(KEY), seconds)
    assert race.due() and race.judge() is None and race.racing()
    decision, _ = run(race, lambda layout, step: {"channels_last": 1.0, "contiguous": 0.8}[layout])
    assert decision.layout == "contiguous"


def test_inputs_whose_shape_changes_every_step_stop_being_raced() -> None:
    race = LayoutRace(max_keys=2)
    for step in range(10):
        key = ((3, 224 + 32 * step, 224), "fp32", "cpu")
        assert race.next_layout(key) == "channels_last"
        race.record(key, 32, "channels_last", 1.0)
    assert not race.decisions


@pytest.mark.parametrize("pattern", ["five of one size, then one of another", "sizes alternating by epoch"])
def test_sizes_that_alternate_keep_their_own_races_and_both_decide(pattern) -> None:
    # one race at a time: each change of size started the other again (its warm-up paid again), the four kinds
    # allowed were used up, and the main size was never decided
    race, small, large = LayoutRace(), KEY, ((3, 48, 48), "fp32", "cpu")
    steps = [small] * 5 + [large] if pattern.startswith("five") else [small] * 12 + [large] * 12
    for step in range(400):
        key = steps[step % len(steps)]
        layout = race.next_layout(key)
        race.record(key, 8, layout, {"channels_last": 1.0, "contiguous": 0.8}[layout] * (2 if key == large else 1))
        if race.due():
            decision = race.judge()
            if decision is not None:
                race.settle(decision)
        if small in race.decisions and large in race.decisions:
            break
    assert race.decisions[small].layout == race.decisions[large].layout == "contiguous", step
    # a checkpoint taken with both under way goes on with both
    half = LayoutRace()
    for step in range(16):
        key = steps[step % len(steps)]
        half.record(key, 8, half.next_layout(key), 1.0)
    restored = LayoutRace()
    restored.load_state_dict(json.loads(json.dumps(half.state_dict())))
    places = [[(r["key"], r["position"]) for r in race.state_dict()["racing"]] for race in (half, restored)]
    assert places[0] == places[1] and len(places[0]) == 2


def test_decisions_travel_in_a_checkpoint_and_are_not_raced_again() -> None:
    race = LayoutRace(warmup=0)
    decision, _ = run(race, lambda layout, step: {"channels_last": 1.0, "contiguous": 0.8}[layout])
    restored = LayoutRace()
    restored.load_state_dict(json.loads(json.dumps(race.state_dict())))  # plain types, as a checkpoint holds them
    assert restored.next_layout(KEY) == "contiguous" and not restored.racing()
    assert restored.decisions[KEY].how == "restored" and restored.decisions[KEY].seconds == decision.seconds


def test_an_earlier_checkpoint_loaded_after_the_decision_leaves_no_race_under_way() -> None:
    # trainer.validate(ckpt_path=<a checkpoint from before the decision>) after the fit: "training ended before the
    # race of the layouts decided", where it had
    race = LayoutRace()
    seconds = lambda layout, step: {"channels_last": 1.0, "contiguous": 0.5}[layout]  # noqa: E731
    run(race, seconds, steps=5)
    early = json.loads(json.dumps(race.state_dict()))
    decision, _ = run(race, lambda layout, step: seconds(layout, step + 5))
    assert early["racing"] and decision is not None
    race.load_state_dict(early)
    assert not race.racing() and race.decisions[KEY] == decision


@pytest.mark.parametrize("stop", range(1, 11))
def test_a_race_stopped_at_any_step_goes_on_where_it_was(stop) -> None:
    def seconds(layout, step):
        return {"channels_last": 1.0, "contiguous": 0.9}[layout] * (1 + 0.001 * (step % 3))

    whole, layouts = run(LayoutRace(), seconds)
    first = LayoutRace()
    _, before = run(first, seconds, steps=stop)
    second = LayoutRace()
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    decided = whole if len(before) == len(layouts) else None
    if decided is None:
        decided, after = run(second, lambda layout, step: seconds(layout, step + stop))
        before += after
        # timed afresh after the resume: its samples are its own steps', less each layout's first
        assert sum(decided.samples.values()) <= len(after) - 2
    assert before[:len(layouts)] == layouts and decided.layout == whole.layout == "contiguous"


@pytest.mark.parametrize("stop", [5, 6, 8])
def test_a_resumed_race_compares_no_step_of_the_stopped_process_and_warms_up_again(stop) -> None:
    # the stopped process's warm channels_last steps (5 ms) against the resumed process's cold NCHW step (110 ms)
    # read "channels_last 19.34x faster" where NCHW is faster
    first = LayoutRace()
    run(first, lambda layout, step: {"channels_last": 0.005, "contiguous": 0.004}[layout], steps=stop)
    second = LayoutRace()
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    cold = set()

    def resumed(layout, step):  # each layout's first step in the new process is slow
        slow = layout not in cold
        cold.add(layout)
        return (0.11 if slow else 0.01) * {"channels_last": 1.0, "contiguous": 0.85}[layout]

    decided, _ = run(second, resumed)
    assert decided.layout == "contiguous" and decided.ratio == pytest.approx(1 / 0.85), decided


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="budget=0"):
        LayoutRace(budget=0)
