"""A rollout worker for unit tests of episodes trained as several sequences: the HF-sampling worker of
`tests.hf_rollout`, whose even-numbered samples of every prompt (two tokens or more) become episodes of two
sequences, as an agent that starts a fresh conversation makes: the first its response's first half, the second
the rest after a prompt of the first prompt and that half (a new context, not a continuation of the row before).
The second sequence carries the response's text (the episode's answer, what a reward function scores); the first
carries the episode's figures."""

from __future__ import annotations

from dataclasses import replace

from distrl.types.prompt import Prompt
from distrl.types.rollouts import Episode, Rollouts
from tests.hf_rollout import HFRolloutWorker


class SegmentedRolloutWorker(HFRolloutWorker):
    episodes_split = 0  # by every instance, for a test to see that some were

    def generate(self, prompts: list[Prompt], groups: list[int]) -> Rollouts:
        whole = super().generate(prompts, groups)
        n = self.cfg.n_samples_per_prompt
        out = Rollouts.empty()
        for i in range(len(whole)):
            ids, lps, versions = whole.response_ids[i], whole.rollout_logprobs[i], whole.token_versions[i]
            prompt, text, reason, group = (whole.prompt_ids[i], whole.response_texts[i], whole.finish_reasons[i],
                                           whole.group[i])
            version = whole.policy_version[i]
            if i % n % 2 or len(ids) < 2:
                out.add(prompt, ids, lps, [1] * len(ids), versions, text, reason, group, whole.episodes[i], version)
                continue
            h = len(ids) // 2
            SegmentedRolloutWorker.episodes_split += 1
            out.add(prompt, ids[:h], lps[:h], [1] * h, versions[:h], "", "stop", group, whole.episodes[i], version)
            out.add(prompt + ids[:h], ids[h:], lps[h:], [1] * (len(ids) - h), versions[h:], text, reason, group,
                    replace(Episode(turns=0), reward=whole.episodes[i].reward, segment=1), version)
        return out.validate()
