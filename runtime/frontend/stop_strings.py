"""Stop strings on streamed text: trim the match, and hold back what could still become one."""

from __future__ import annotations


class StopStringMatcher:
    """Feed it text as it is generated; it says what is safe to show and when to stop."""

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self._stops = stops
        self._include_stop = include_stop  # release the matched stop string too
        self._longest = max(len(s) for s in stops)
        self._held = ""  # text received but not yet released

    def feed(self, text: str, final: bool) -> tuple[str, str | None]:
        """Returns (text to release now, the stop string matched or None).

        After a match, the text before it is released and nothing more should be fed.
        """
        self._held += text
        # the stop that completes first, as if the text came one character at a time: so how
        # the text is cut into pieces never changes where it stops
        first: tuple[int, int, str] | None = None
        for stop in self._stops:
            at = self._held.find(stop)
            if at >= 0 and (first is None or (at + len(stop), at) < first[:2]):
                first = (at + len(stop), at, stop)
        if first is not None:
            end = first[0] if self._include_stop else first[1]
            released, self._held = self._held[:end], ""
            return released, first[2]
        keep = 0 if final else self._partial_match_length()
        cut = len(self._held) - keep
        released, self._held = self._held[:cut], self._held[cut:]
        return released, None

    def _partial_match_length(self) -> int:
        """Length of the longest tail of the held text that begins some stop string."""
        held = self._held
        for length in range(min(len(held), self._longest - 1), 0, -1):
            tail = held[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
