"""How a fit's tasks and its driver exchange bytes: the rendezvous of a barrier stage's process
group (rendezvous.py), the authenticated channel from the tasks to the driver (channel.py),
all-reduce through shared memory between tasks on one host (shm.py; ddp_hook.py: the same as a
DDP communication hook), and the parameter server (ps/)."""
