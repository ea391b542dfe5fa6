"""A discrete-event simulation of a fleet of inferd pods, seeded and reproducible.

It runs the fleet controller's decisions (inferd/fleet/decisions.py) unchanged
against a model of the default kube-scheduler, a diurnal traffic trace with a
rollout, and GPU memory that fragments under traffic. `python -m deploy.sim.run`
prints what it finds; README.md here says what the figures show.

    fleet.py      nodes, GPUs, models and pods, and the per-node counts the scheduler reads
    memory.py     each pod's reserved and unused GPU memory as traffic moves it
    scheduler.py  the default scheduler's filter and scores for these pods
    traffic.py    the request trace, the autoscaler and the rollout's timing
    controller.py inferd-fleet: observe, decide (the decision functions), act
    engine.py     one scenario's run, step by step, and its figures
    run.py        the command line: scenarios, the affinity-weight sweep, the tables
"""
