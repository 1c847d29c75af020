"""services/gateway/relay.py: a re-run's tokens on a stream already begun."""

from __future__ import annotations

import pytest

from services.gateway.relay import RerunDiverged, StreamedTokens
from shared.schema import CallTokens

WORDS = "one two three four five six seven eight".split()


def ev(index: int, n: int, words: list[str] = WORDS) -> CallTokens:
    return CallTokens(call_id="c", index=index, token_ids=list(range(index, index + n)),
                      text="".join(w + " " for w in words[index:index + n]))


def relayed_text(events: list[CallTokens]) -> str:
    s = StreamedTokens()
    out = [s.accept(e) for e in events]
    return "".join(e.text or "" for e in out if e is not None)


def test_a_first_run_is_relayed_as_it_comes() -> None:
    assert relayed_text([ev(0, 2), ev(2, 3), ev(5, 3)]) == "one two three four five six seven eight "


@pytest.mark.parametrize("rerun", [
    [ev(0, 2), ev(2, 3), ev(5, 3)],          # chunked as the first run
    [ev(0, 3), ev(3, 3), ev(6, 2)],          # otherwise: an event straddles what was sent
    [ev(0, 8)],                              # all at once
])
def test_a_rerun_that_repeats_what_was_sent_adds_only_what_goes_past_it(rerun: list[CallTokens]) -> None:
    first = [ev(0, 2), ev(2, 2)]  # four tokens sent, then the engine restarted
    assert relayed_text(first + rerun) == "one two three four five six seven eight "
    s = StreamedTokens()
    for e in first + rerun:
        past = s.accept(e)
        assert past is None or past.index == len(s.ids) - len(past.token_ids)  # positions stay whole


def test_a_second_rerun_is_checked_as_the_first() -> None:
    assert relayed_text([ev(0, 3), ev(0, 1), ev(0, 2), ev(2, 4), ev(6, 2)]) == \
        "one two three four five six seven eight "


@pytest.mark.parametrize("rerun", [
    [ev(0, 2, ["one", "TWO"] + WORDS[2:])],                   # within what was sent
    [ev(0, 5, WORDS[:3] + ["FOUR"] + WORDS[4:])],            # straddling it
])
def test_a_rerun_that_differs_from_what_was_sent_is_refused(rerun: list[CallTokens]) -> None:
    s = StreamedTokens()
    s.accept(ev(0, 4))
    with pytest.raises(RerunDiverged):
        for e in rerun:
            s.accept(e)


def test_a_rerun_must_begin_at_the_first_token() -> None:
    s = StreamedTokens()
    s.accept(ev(0, 4))
    with pytest.raises(RerunDiverged):
        s.accept(ev(2, 2))


def test_tokens_lost_on_the_way_stop_the_relay_and_a_rerun_mends_it() -> None:
    """Tokens published while the gateway's connection was away never come: relaying what
    came after them gave the agent a reply with those words missing (its text is no
    longer a prefix of the reply's, so the reply's rest could not mend it). Nothing past
    the hole is relayed; the reply's text brings the rest. A re-run from the first token
    fills the hole and the relay goes on."""
    assert relayed_text([ev(0, 2), ev(4, 2), ev(6, 2)]) == "one two "
    s = StreamedTokens()
    out = [s.accept(e) for e in (ev(0, 2), ev(4, 2), ev(0, 6), ev(6, 2))]
    assert "".join(e.text or "" for e in out if e is not None) == "one two three four five six seven eight "
    assert not s.gapped
