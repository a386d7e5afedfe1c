"""The Responses API's stored responses (`serve/response_store.py`): time to live, cap, and which
sessions a forgotten response hands back for deletion. A fake clock; no web stack needed."""

from __future__ import annotations

import pytest

from stateful_hf.serve.response_store import PromptKey, ResponseRetention, ResponseStore, StoredResponse


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def response(rid: str, session: str | None = None, tenant: str = "t", owns: bool = True) -> StoredResponse:
    return StoredResponse(rid, tenant, session or f"sess-{rid}", owns, [], {"id": rid}, prompt=PromptKey.of(PROMPT))


PROMPT = [5, 6, 7, 8]


def test_ttl_forgets_and_hands_back_the_servers_sessions():
    clock = Clock()
    store = ResponseStore(ResponseRetention(ttl=10.0, cap=100), clock=clock)
    a, b = response("a"), response("b", owns=False)      # b ran in the client's X-Session-Id
    assert store.put(a) == [] and store.put(b) == []
    clock.now = 9.9
    assert store.get("t", "a") is a and store.get("other", "a") is None    # another tenant's id: unknown
    clock.now = 10.0
    assert store.get("t", "a") is None and store.get("t", "b") is None     # expired
    assert store.put(response("c")) == ["sess-a"]          # b's session is the client's: not deleted
    assert len(store) == 1


def test_cap_forgets_the_oldest():
    store = ResponseStore(ResponseRetention(ttl=1e9, cap=3), clock=Clock())
    for i in range(3):
        assert store.put(response(f"r{i}")) == []
    assert store.put(response("r3")) == ["sess-r0"]
    assert [store.get("t", f"r{i}") is not None for i in range(4)] == [False, True, True, True]
    dropped = [s for i in range(4, 2004) for s in store.put(response(f"r{i}"))]
    assert dropped == [f"sess-r{i}" for i in range(1, 2001)] and len(store) == 3


def test_a_session_still_heading_a_response_is_kept():
    store = ResponseStore(ResponseRetention(ttl=1e9, cap=2), clock=Clock())
    first = response("a", session="s")
    store.put(first)
    assert store.claim(first, PROMPT + [9]) and not store.claim(first, PROMPT)   # the first runs in s; later fork
    store.put(response("b", session="s"))                  # its answer: s now ends with b
    assert store.put(response("c")) == []                   # a goes: claimed, so s lives on with b
    assert store.put(response("d")) == ["s"]  # b goes: nothing heads s any more
    two = [response("x", session="shared"), response("y", session="shared")]
    for r in two:
        store.put(r)
    assert store.delete("t", "x")[1] == []                  # y still heads "shared"
    assert store.delete("t", "y") == (two[1], ["shared"])
    assert store.delete("t", "y") == (None, [])


def test_delete_of_an_expired_response_forgets_it():
    clock = Clock()
    store = ResponseStore(ResponseRetention(ttl=5.0, cap=10), clock=clock)
    store.put(response("a"))
    clock.now = 6.0
    assert store.delete("t", "a") == (None, ["sess-a"])
    assert len(store) == 0


@pytest.mark.parametrize(("kwargs", "says"), [({"ttl": 0}, "responses_ttl must be a number of seconds > 0"),
                                              ({"ttl": True}, "responses_ttl"), ({"cap": 0}, "responses_cap"),
                                              ({"cap": 2.5}, "responses_cap must be an int >= 1")])
def test_bad_retention_names_its_field(kwargs, says):
    with pytest.raises(ValueError, match=says):
        ResponseRetention(**kwargs)


def test_only_a_continuation_that_extends_the_prompt_claims_the_session():
    """A continuation whose prompt does not start with the response's (other instructions) forks, and
    leaves the session to one that does: the session's history is never cut."""
    store = ResponseStore(ResponseRetention(ttl=1e9, cap=10), clock=Clock())
    r = response("a", session="s")
    store.put(r)
    assert not store.claim(r, [1, 5, 6, 7, 8, 9])          # other instructions: a fork
    assert not store.claim(r, PROMPT[:3])                   # shorter than the prompt
    assert not store.claim(r, [5, 6, 7, 0, 9])             # differs inside it
    assert not r.claimed and store.claim(r, PROMPT + [1, 2]) and not store.claim(r, PROMPT + [3])
    unknown = StoredResponse("c", "t", "s", True, [], {})    # no prompt key: never claimed
    assert not store.claim(unknown, PROMPT)
    assert PromptKey.of(PROMPT).prefixes(PROMPT) and not PromptKey.of(PROMPT).prefixes([5, 6, 7, 9])


def test_a_background_response_while_running_and_once_ended():
    """Running (no messages): stored, never claimed, its session never handed back; ended with a reply:
    stored over it, continuable; ended without one (cancelled, failed): its own server-named session is
    handed back at once unless a stored response heads it; the client's session never is."""
    store = ResponseStore(ResponseRetention(ttl=1e9, cap=100), clock=Clock())
    running = StoredResponse("bg", "t", "sess-bg", True, None, {"id": "bg", "status": "in_progress"})
    assert store.put(running) == [] and not store.claim(running, PROMPT)
    assert store.put(response("bg", "sess-bg")) == []                 # completed: replaces it, heads its session
    assert store.claim(store.get("t", "bg"), PROMPT)
    for rid, session, owns, want in [("x", "sess-x", True, ["sess-x"]), ("y", "sess-y", False, []),
                                     ("z", "sess-h", True, [])]:
        if rid == "z":
            store.put(response("h", "sess-h"))                         # another response heads sess-h
        store.put(StoredResponse(rid, "t", session, owns, None, {"id": rid, "status": "queued"}))
        ended = StoredResponse(rid, "t", session, owns, None, {"id": rid, "status": "cancelled"})
        assert store.put(ended) == want, rid
        assert store.get("t", rid) is ended and not store.claim(ended, PROMPT)
