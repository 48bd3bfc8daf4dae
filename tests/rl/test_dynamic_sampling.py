"""rl.scored_groups: the rounds of dynamic sampling, the padding of prompts of different
widths, the weight-0 filler of a rank that kept no group, and rewards that are not one finite
number per response."""

import pytest
import torch

from dualkv_compile.rl import dynamic_sampling
from dualkv_compile.rl.dynamic_sampling import REFILL_ROUNDS, scored_groups

N, T, PAD = 2, 3, 0


class Script:
    """Rounds of prompts (each [need, width], ids from 1 up) whose rewards are scripted: group
    g of round r gets rewards[r][g] for its N rows."""

    def __init__(self, widths, rewards):
        self.widths, self.rewards, self.draws, self.next_id = widths, rewards, [], 1

    def draw(self, need):
        width = self.widths[len(self.draws)]
        self.draws.append(need)
        prompts = torch.arange(self.next_id, self.next_id + need * width).view(need, width)
        self.next_id += need * width
        return prompts, [f"answer{len(self.draws)}-{g}" for g in range(need)]

    def rollout(self, prompts):
        batch = prompts.repeat_interleave(N, 0)
        response = torch.full((len(batch), T), 99)
        tokens = torch.cat([batch, response], 1)
        return tokens, torch.ones_like(tokens, dtype=torch.bool), torch.full((len(batch),), T)

    def score(self, responses, answers, lengths):
        assert responses.shape[1] == T and len(answers) == len(responses) == len(lengths)
        r = len(self.draws) - 1
        return torch.tensor([x for pair in self.rewards[r] for x in pair], dtype=torch.float64)


def run(script, groups, dynamic):
    return scored_groups(script.draw, script.rollout, script.score, groups=groups,
                         group_size=N, dynamic_sampling=dynamic, pad_id=PAD)


def test_one_round_keeps_every_group_without_dynamic_sampling():
    s = Script([2], [[(1.0, 1.0), (0.0, 1.0)]])
    out = run(s, 2, False)
    assert s.draws == [2] and not out.filler and out.prompt_len == 2
    assert out.rewards.tolist() == [[1.0, 1.0], [0.0, 1.0]]
    assert out.tokens[:, :2].tolist() == [[1, 2], [1, 2], [3, 4], [3, 4]]


def test_rounds_refill_dropped_groups_and_left_pad_narrow_prompts():
    # round 1 (width 2): group 0 flat, group 1 kept; round 2 (width 3): group 0 kept
    s = Script([2, 3], [[(1.0, 1.0), (0.0, 1.0)], [(1.0, 0.0)]])
    out = run(s, 2, True)
    assert s.draws == [2, 1]
    assert out.prompt_len == 3 and out.rewards.tolist() == [[0.0, 1.0], [1.0, 0.0]]
    # the kept round-1 group (prompt 3, 4) is left-padded to width 3; its mask says so
    assert out.tokens[:2, :3].tolist() == [[PAD, 3, 4]] * 2
    assert out.mask[:2, 0].tolist() == [False, False] and out.mask[:2, 1:].all()
    assert out.tokens[2:, :3].tolist() == [[5, 6, 7]] * 2
    assert out.lengths.tolist() == [T] * 4
    assert out.sampled.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]  # dropped groups included


def test_rounds_run_out_with_fewer_groups():
    flat = [(1.0, 1.0)]
    s = Script([2] * REFILL_ROUNDS, [[(0.0, 1.0)] + flat * 2] + [flat * 2] * (REFILL_ROUNDS - 1))
    out = run(s, 3, True)
    assert s.draws == [3] + [2] * (REFILL_ROUNDS - 1)
    assert out.rewards.shape == (1, N) and not out.filler


def test_no_group_with_signal_anywhere_raises():
    s = Script([2] * REFILL_ROUNDS, [[(1.0, 1.0)]] * REFILL_ROUNDS)
    with pytest.raises(RuntimeError, match="no group with differing rewards"):
        run(s, 1, True)


def test_rank_without_kept_groups_trains_last_round_as_filler(monkeypatch):
    # another rank kept groups: the sum over ranks is positive while this rank kept none
    monkeypatch.setattr(dynamic_sampling.ddp, "all_sum", lambda *x: [v + 1 for v in x])
    s = Script([2] * REFILL_ROUNDS, [[(1.0, 1.0)]] * (REFILL_ROUNDS - 1) + [[(0.0, 0.0)]])
    out = run(s, 1, True)
    assert out.filler and out.rewards.tolist() == [[0.0, 0.0]]
    first = 1 + 2 * (REFILL_ROUNDS - 1)  # the last round's prompt ids
    assert out.tokens[0, :2].tolist() == [first, first + 1]


@pytest.mark.parametrize("rewards,match", [
    (torch.tensor([1.0, float("nan"), 0.0, 1.0]), r"non-finite rewards for responses \[1\]"),
    (torch.tensor([1.0, float("inf"), 0.0, 1.0]), r"non-finite rewards for responses \[1\]"),
    (torch.tensor([1.0, 0.0]), r"rewards of \(2,\); it must return .* shape \(4,\)"),
    (torch.ones(4, 1), r"rewards of \(4, 1\)"),
    ([1.0, 0.0, 1.0, 0.0], r"rewards of list"),
])
def test_rewards_that_are_not_one_finite_number_per_response_are_named(rewards, match):
    # a failed grader's NaN was kept (NaN != NaN reads as signal) and ended the run as "a
    # learning rate too high"; a wrong shape was a bare view() error or broadcast
    s = Script([2], [[(1.0, 0.0), (0.0, 1.0)]])
    s.score = lambda responses, answers, lengths: rewards
    with pytest.raises(ValueError, match="score\\(\\) returned " + match):
        run(s, 2, True)


def test_group_advantages_refuse_non_finite_rewards():
    from dualkv_compile.rl import group_advantages

    with pytest.raises(ValueError, match=r"non-finite values in groups \[1\]"):
        group_advantages(torch.tensor([[1.0, 0.0], [float("nan"), 1.0]]))


@pytest.mark.parametrize("dynamic", [False, True])
def test_no_groups_asked_for_is_named(dynamic):
    # groups=0 raised NoGroupWithSignal, "dynamic sampling found no group", with it off
    with pytest.raises(ValueError, match="groups=0 must be an integer >= 1"):
        scored_groups(lambda need: None, lambda prompts: None, lambda *a: None, groups=0,
                      group_size=2, dynamic_sampling=dynamic, pad_id=0)


def test_a_draw_or_rollout_that_breaks_its_contract_is_named():
    # a prompt too few or a row dropped was reported as score()'s wrong reward count; fewer
    # answers than prompts were scored misaligned; a list of prompts was a bare AttributeError
    s = Script([2], [[(1.0, 1.0), (0.0, 1.0)]])
    short = lambda need: (s.draw(need)[0][:-1], ["a"] * (need - 1))  # noqa: E731
    few_answers = lambda need: (s.draw(need)[0], ["a"] * (need - 1))  # noqa: E731
    as_list = lambda need: (s.draw(need)[0].tolist(), ["a"] * need)  # noqa: E731
    dropped_row = lambda prompts: tuple(x[:-1] for x in s.rollout(prompts))  # noqa: E731
    cases = [(short, s.rollout, r"draw\(2\) returned prompts of \(1, 2\)"),
             (few_answers, s.rollout, r"draw\(2\) returned 1 answers for 2 prompts"),
             (as_list, s.rollout, r"draw\(2\) returned prompts of list"),
             (s.draw, dropped_row, r"rollout\(\) returned \[\(3, 5\), \(3, 5\), \(3,\)\]; it "
                                   r"must return \(tokens, mask, lengths\) of 4 rows")]
    for draw, rollout, match in cases:
        s.draws.clear()
        with pytest.raises(dynamic_sampling.BatchRefused, match=match):
            scored_groups(draw, rollout, s.score, groups=2, group_size=N, dynamic_sampling=True,
                          pad_id=PAD)


def test_an_error_raised_in_the_grader_keeps_its_type_and_traceback():
    # it was wrapped in BatchRefused, which the recipe prints as one line without the line of
    # the grader that raised it
    s = Script([2], [[(1.0, 1.0), (0.0, 1.0)]])

    def buggy_score(responses, answers, lengths):
        return {}["a typo in the grader"]

    with pytest.raises(KeyError, match="a typo in the grader") as e:
        scored_groups(s.draw, s.rollout, buggy_score, groups=2, group_size=N,
                      dynamic_sampling=False, pad_id=PAD)
    assert e.traceback[-1].name == "buggy_score"
