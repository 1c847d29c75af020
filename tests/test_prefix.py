"""Prefix identity by chained block hashes, and the matching of header-less requests
to their sessions (services/gateway/prefix.py: pure)."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from services.gateway import prefix as px

B = px.BLOCK_TOKENS


def conv(*turns: tuple[str, str]) -> list[bytes]:
    return px.block_hashes(px.conversation_ids(list(turns)))


def test_a_chain_names_each_full_block_by_everything_before_it() -> None:
    ids = px.text_ids("x" * (4 * B * 3 + 8))  # three full blocks and half of a fourth
    chain = px.block_hashes(ids)
    assert len(chain) == 3 and len(set(chain)) == 3  # equal blocks, different places: different names
    assert all(len(h) == px.HASH_BYTES for h in chain)
    # hashing the rest from the last hash continues the same chain
    assert chain[:2] + px.block_hashes(ids[2 * B:], chain[1]) == chain
    assert px.unpack(px.pack(chain)) == chain


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=20 * B), st.lists(st.integers(0, 2**32 - 1), max_size=20 * B))
def test_common_blocks_is_the_longest_shared_run_of_full_blocks(a: list[int], b: list[int]) -> None:
    from array import array

    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    ca, cb = px.block_hashes(array("I", a)), px.block_hashes(array("I", b))
    assert px.common_blocks(ca, cb) == min(common // B, len(ca), len(cb))


def test_a_conversation_resent_verbatim_keeps_its_prefix_and_a_rewritten_turn_ends_it() -> None:
    system, task = ("system", "you are a coding agent " * 30), ("user", "fix the failing test " * 40)
    call1 = px.conversation_ids([system, task])
    held = call1 + px.message_ids("assistant", "")  # what the engine holds after answering
    call2 = [system, task, ("assistant", ""), ("user", "tool output " * 50)]
    shared = px.common_blocks(px.block_hashes(held), conv(*call2))
    assert shared == len(held) // B  # all of it, block-rounded
    # a history re-serialised differently (the tool call's JSON in another key order) keeps only what came before it
    edited = "fix the failing test " * 39 + "fix the failing tesT "
    rewritten = [system, ("user", edited), ("assistant", ""), call2[3]]
    first_change = len(px.conversation_ids([system])) + px.MESSAGE_FRAME_TOKENS + edited.index("tesT ") // 4
    assert px.common_blocks(px.block_hashes(held), conv(*rewritten)) == first_change // B


def test_a_header_less_request_joins_the_longest_open_session_it_extends() -> None:
    base = px.conversation_ids([("user", "task A " * 100)])
    other = px.conversation_ids([("user", "task B " * 100)])
    chain_a, chain_b = px.block_hashes(base), px.block_hashes(other)
    now = 1000.0
    opens = [px.OpenChain("a-short", 3, chain_a[2], now - 5), px.OpenChain("a-long", len(chain_a), chain_a[-1], now - 5),
             px.OpenChain("b", len(chain_b), chain_b[-1], now - 1), px.OpenChain("a-idle", 2, chain_a[1], now - 9999)]
    nxt = px.block_hashes(base + px.message_ids("user", "more " * 40))
    found = [o.session_id for o in px.extended_by(nxt, opens, now, idle_s=600)]
    assert found == ["a-long", "a-short"]  # longest first; B's chain diverges; an idle one is not joined
    assert px.extended_by(px.block_hashes(px.text_ids("unrelated " * 80)), opens, now, 600) == []
    # a request shorter than a session's chain cannot extend it
    assert [o.session_id for o in px.extended_by(chain_a[:3], opens, now, 600)] == ["a-short"]


def test_open_chains_encode_and_refuse_garbage() -> None:
    o = px.OpenChain("s", 7, b"\x01" * 8, 12.5)
    assert px.OpenChain.decode("s", o.encode()) == o
    assert px.OpenChain.decode("s", "nonsense") is None and px.OpenChain.decode("s", "1:zz:3") is None


def test_a_sessions_branches_keep_what_a_side_call_did_not_extend() -> None:
    """A title call under the conversation's own header leaves a branch of its own; the
    conversation's next turn still holds what the conversation's branch holds."""
    h = [bytes([i]) * px.HASH_BYTES for i in range(40)]
    talk, title = h[:30], h[30:33]
    branches = px.with_branch(px.with_branch([], talk), title)
    assert branches == [title, talk]
    assert px.held_blocks(branches, h[:35]) == 30 and px.held_blocks(branches, title + h[:2]) == 3
    # the conversation continued replaces its own branch, and the title's is kept beside it
    assert px.with_branch(branches, h[:36]) == [h[:36], title]
    # at most BRANCHES_KEPT, the newest first; a branch the new chain extends is not kept twice
    many = [[bytes([100 + i]) * px.HASH_BYTES] for i in range(px.BRANCHES_KEPT + 2)]
    kept: list = []
    for b in many:
        kept = px.with_branch(kept, b)
    assert kept == many[::-1][:2]  # (branches of one length: twice the longest holds two)
    kept = px.with_branch([[bytes([100 + i]) * px.HASH_BYTES] for i in range(6)], h[:10])
    assert len(kept) == px.BRANCHES_KEPT and kept[0] == h[:10]
    assert px.unpack_branches(px.pack_branches(kept)) == kept and px.unpack_branches(None) == []
    # what is cut short or malformed ends the list (soft state: never an error)
    packed = px.pack_branches([talk, title])
    assert px.unpack_branches(packed[:-1]) == [talk] and px.unpack_branches(b"\0\0\0\0junk") == []
    assert px.held_blocks([], talk) == 0
    # a history compacted again and again keeps at most twice its longest branch's blocks
    long = [[bytes([200 + i]) * px.HASH_BYTES] * 100 for i in range(3)]
    assert px.with_branch(px.with_branch([long[0]], long[1]), long[2]) == [long[2], long[1]]


def test_stand_in_ids_count_as_the_estimate_and_frames_never_collide_with_text() -> None:
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x2FFF), 0x1F600])) for _ in range(rng.randrange(0, 40)))
        ids = px.text_ids(text)
        assert len(ids) == max(1, -(-len(text.encode("utf-8", "surrogatepass")) // 4))
        assert not set(ids) & set(px.frame_ids("user"))
    assert px.frame_ids("user") != px.frame_ids("assistant")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["extend", "edit", "other", "shrink"]), st.integers(0, 3 * B),
                          st.integers(0, 2**32 - 1)), min_size=1, max_size=12))
def test_the_chain_cache_gives_exactly_the_full_hash_whatever_the_conversation_does(
        steps: list[tuple[str, int, int]]) -> None:
    from array import array

    cache = px.ChainCache(max_bytes=4 * 40 * B)  # small: evictions happen too
    ids = array("I", range(2 * B + 3))
    for op, n, v in steps:
        if op == "extend":
            ids = ids + array("I", [v] * n)
        elif op == "edit" and len(ids):
            ids = array("I", ids)
            ids[n % len(ids)] = v
        elif op == "shrink":
            ids = ids[: max(1, len(ids) - n)]
        else:
            ids = array("I", [v]) + ids[1:]  # another conversation, another first block
        assert cache.chain("t\0m", ids) == px.block_hashes(ids)
        held = ids + array("I", [7] * (n % 20))  # the reply: the next prompt may extend it
        assert cache.chain("t\0m", held) == px.block_hashes(held)


def test_the_chain_cache_holds_about_the_memory_it_is_bounded_to() -> None:
    """Its bound is memory, not the ids' bytes alone: many short prompts (a header-less
    agent's first calls, say) filled 2.5x the bound when only their ids were counted."""
    import tracemalloc
    from array import array

    bound = 2 << 20
    cache = px.ChainCache(max_bytes=bound)
    prompts = [array("I", [n] * 110) for n in range(40_000)]  # 110 ids, 6 blocks each
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for ids in prompts:
            cache.chain("tenant\0model", ids)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= 1.25 * bound, f"{held / bound:.2f}x its bound"
