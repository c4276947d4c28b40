"""Rollout workers that feed the trainer replicas through the store (``[rollouts]``, issue 36).

Two concepts live here, each in its own module:

* the **policy chain**: the policy the workers sample from, published to the store after every outer step as an
  anchor plus lossless bf16 patches (or the LoRA adapter alone), rebuilt bitwise by a worker and checked against a
  digest in the signed record;
* the **rollout batches**: signed, write-once records of generated completions (token ids, the sampler's per-token
  log-probs, rewards, the policy version used), named by the trainer step that consumes them, so that a resumed
  run reads exactly the batches it read before.

The package sits on the sync-and-model floor: the replica (which publishes the policy and consumes batches) and the
worker job both import it; it imports storage, sync, trainer and the foundation, never the replica or the client.
"""
