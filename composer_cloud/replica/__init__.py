"""What runs in a replica job (``python -m composer_cloud.replica``): the inner loop, its boundaries, its reports.

* ``__main__``: the entry point; reads the job's environment once;
* :mod:`.runtime`: builds model and trainer, runs THE inner loop of both sync modes;
* :mod:`.boundary`: what the loop and the boundary strategies share;
* :mod:`.lockstep`, :mod:`.decoupled`: the boundary strategy of each sync mode;
* :mod:`.telemetry`: metrics objects, live progress, heartbeats;
* :mod:`.usercode`: the run's user code and files, verified and installed;
* :mod:`.faults`: crash-test fault hooks from the environment (tests only).

The replica never imports the client (``composer_cloud.runs``), and nothing below it imports the replica.
"""
