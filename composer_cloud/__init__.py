"""composer-cloud: DiLoCo post-training across independent serverless jobs.

Replicas never talk to each other: they synchronise DiLoCo pseudo-gradients
through an object store (``file://``, ``s3://`` or any fsspec filesystem).
"""

__version__ = "0.1.0"
