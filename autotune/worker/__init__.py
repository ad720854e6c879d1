"""A worker process: what the study starts to answer one request in a process of its own.

``serve`` answers a request of any kind (a trial, the probe, a memory probe, an accuracy or parity check),
dispatching to the trial's side (autotune.trial) or the check's (autotune.accuracy.worker); ``zygote`` is
the CPU's fork server, which imports once and forks a worker per request. The study's side (autotune.trial.
runner) starts them by module name and reads their answers: it imports neither.
"""
