"""actors.worker.kv_log: followers get increments, or the whole state when they cannot be incremental."""

from actors.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from actors.worker.kv_log import KvLog
from serve_app.kv_follower import KvFollower
from serve_app.prefix_index import KvEventIndex, hash_token_blocks

TOKENS = tuple(range(64))


def stored(hashes, parent=None, tokens=TOKENS):
    return BlockStored(tuple(hashes), parent, tokens[: 16 * len(hashes)], 16)


def test_a_current_cursor_gets_only_new_entries():
    log = KvLog()
    log.apply(0, (stored([1, 2]),))
    first = log.since(None, 0)
    assert first.full and first.seq == 1
    log.apply(0, (BlockRemoved((2,)),))
    inc = log.since(log.epoch, 1)
    assert not inc.full and [e.seq for e in inc.entries] == [2]


def test_a_cursor_older_than_the_log_or_from_another_epoch_gets_the_whole_state():
    log = KvLog(max_entries=2)
    for i in range(5):
        log.apply(0, (stored([10 + i]),))
    assert log.since(log.epoch, 1).full
    assert log.since("other", 5).full
    state = log.since("other", 5).entries
    assert sorted(ev.block_hashes[0] for e in state for ev in e.events) == [10, 11, 12, 13, 14]


def test_removal_clear_and_lost_rank_shrink_the_state():
    log = KvLog()
    log.apply(0, (stored([1, 2, 3]),))
    log.apply(1, (stored([7]),))
    log.apply(0, (BlockRemoved((3,)),))
    assert log.blocks(0) == 2
    log.lose_rank(0)
    assert log.blocks(0) == 0 and log.blocks(1) == 1
    log.apply(1, (AllBlocksCleared(),))
    assert log.blocks(1) == 0


def test_follower_rebuilds_the_index_from_a_full_answer_and_applies_increments():
    index = KvEventIndex(16)
    f = KvFollower(index, resolve=None)  # type: ignore[arg-type]
    log = KvLog()
    log.apply(0, (stored([101, 102, 103, 104]),))
    f.apply("w", log.since(None, 0))
    prompt = hash_token_blocks(TOKENS, 16)
    assert index.overlap(prompt) == {"w": 4}
    log.apply(0, (BlockRemoved((104,)),))
    f.apply("w", log.since(log.epoch, 1))
    assert index.overlap(prompt) == {"w": 3}
    log.lose_rank(0)
    f.apply("w", log.since(log.epoch, 2))
    assert index.overlap(prompt) == {}
