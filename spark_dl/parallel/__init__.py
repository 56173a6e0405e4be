"""What the strategies share: the rendezvous, shared memory, the authenticated message
channel, the parameter server and its wire protocol, the task scaffold (stage.py), model
parallelism and its cost model. The strategies themselves are in spark_dl.strategies."""
