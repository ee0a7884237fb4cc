"""ParameterServerStrategy's layer: servers, their TCP requests, remote variables, the cluster coordinator.

``rpc`` (frames and connections), ``server_lib`` (``md.distribute.Server``: the ps store and the worker's
executor), ``values`` (variables on ps tasks, ``ShardedVariable``, ``RemoteValue``), ``optimizer_state`` (an
optimizer's slots and step count on the ps tasks, and its updates there), ``partitioners``,
``strategy`` (``ParameterServerStrategy``) and ``coordinator`` (``ClusterCoordinator``). docs/parameter_server.md.
"""
