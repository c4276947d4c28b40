"""Checkpoints: the one owner of everything under ``checkpoints/`` (and of replicas' inner states), both sync modes.

* :mod:`.global_state`: global states written as slices by every participant, read back verified;
* :mod:`.replica_state`: each replica's inner state (optimizer, data position, RNGs);
* :mod:`.manifests`: manifests (written last), the newest valid checkpoint, pruning, and the version API
  the decoupled mode calls.

Every read names the attempt whose state it wants, or takes the sync mode's
``attempt_of`` (lock-step: the round's committed attempt; decoupled: 0), so
this package never reads round records.
"""
