"""How ``select`` picks a choice from the log-probabilities of each choice's tokens.

These are SGLang's three methods, with its semantics:

- :data:`token_length_normalized` (the default): the highest mean log-probability over the
  choice's tokens.
- :data:`greedy_token_selection`: the highest log-probability of the first token, ties broken by
  the next token and so on; a shorter choice is padded with its own mean.
- :data:`unconditional_likelihood_normalized`: the highest mean of (log-probability given the
  prompt - log-probability of the choice on its own).

``input_token_logprobs`` is, per choice, a list of ``(logprob, token_id, token_text)``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


def _argmax_first(values: list[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best] or (math.isnan(values[best]) and not math.isnan(v)):
            best = i
    return best


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


class ChoicesSamplingMethod(ABC):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[Any]],
        output_token_logprobs: list[list[Any]],
        unconditional_token_logprobs: list[list[Any]] | None = None,
    ) -> ChoicesDecision: ...

    def __repr__(self) -> str:
        return type(self).__name__


class TokenLengthNormalized(ChoicesSamplingMethod):
    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _argmax_first(normalized_prompt_logprobs)
        return ChoicesDecision(
            choices[best],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
            },
        )


class GreedyTokenSelection(ChoicesSamplingMethod):
    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        width = max(len(option) for option in input_token_logprobs)
        matrix = []
        for option in input_token_logprobs:
            values = [t[0] for t in option]
            matrix.append(values + [_mean(values)] * (width - len(values)))
        remaining = list(range(len(choices)))
        for j in range(width):
            top = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == top]
            if len(remaining) == 1:
                break
        return ChoicesDecision(
            choices[remaining[0]],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
                "greedy_logprob_matrix": matrix,
            },
        )


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        scores = []
        for given, alone in zip(input_token_logprobs, unconditional_token_logprobs):
            a = [t[0] for t in given]
            b = [t[0] if t[0] is not None else 0.0 for t in alone]
            if len(a) != len(b):
                raise ValueError("conditional and unconditional logprobs differ in length")
            scores.append(_mean([x - y for x, y in zip(a, b)]))
        return ChoicesDecision(
            choices[_argmax_first(scores)],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
                "unconditional_token_logprobs": unconditional_token_logprobs,
                "normalized_unconditional_prompt_logprobs": scores,
            },
        )


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
