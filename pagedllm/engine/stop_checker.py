"""Stop strings, matched on a request's incrementally decoded text, also when one spans several tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StopMatch:
    stop: str  # the stop string found
    end: int  # the text keeps text[:end]: up to the stop string, or through it with include_stop_str_in_output


class StopChecker:
    def __init__(self, stop: list[str], include_stop_str_in_output: bool):
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        # Streamed text holds back this many trailing characters: a stop string completed later can remove at most
        # its length - 1 characters of text already decoded (none when the stop string stays in the output).
        self.holdback = max(map(len, stop), default=1) - 1 if not include_stop_str_in_output else 0

    def find(self, text: str, new_start: int) -> StopMatch | None:
        """The earliest stop string in `text` that ends after `new_start` (text before it was already checked)."""
        best: StopMatch | None = None
        best_index = len(text)
        for stop in self.stop:
            index = text.find(stop, max(0, new_start - len(stop) + 1))
            if index != -1 and index < best_index:
                best_index = index
                best = StopMatch(stop, index + len(stop) if self.include_stop_str_in_output else index)
        return best
