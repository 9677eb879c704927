"""One job's store protocol, for the processes inside the job and those outside it (the
launcher, ``tether dump``, the cluster page): alarms and their answers (:mod:`.alarm`), the
client that reaches a running job (:mod:`.client`), the ``.jobs/`` files that find it
(:mod:`.jobfile`), and the stack signal with which a rank's threads are read (:mod:`.stacks`).

Torch-free at import: the store is torch's, but only reached through an object handed in or a
client made on demand."""
