"""Checkpointing, in one room: what a checkpoint holds and how it is saved so that no failure loses
the last good one (store.py: DCP save, load and the choice of the latest valid one; writer.py: the
staged writes and injected faults; manifest.py: sizes and sha256 of every file, verified before a
load), what the trainer's state becomes inside it (state.py), the policy of when to save and what
to do when a save fails (checkpointer.py), and the refusal of anything a crafted checkpoint could
run (untrusted.py)."""
