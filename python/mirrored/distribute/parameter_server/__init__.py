"""ParameterServerStrategy's layer: servers, their TCP requests, remote variables, the cluster coordinator.

``rpc`` (frames and connections), ``server_lib`` (``md.distribute.Server``: the ps store and the worker's
executor), ``values`` (variables on ps tasks, ``ShardedVariable``, ``RemoteValue``), ``partitioners``,
``strategy`` (``ParameterServerStrategy``) and ``coordinator`` (``ClusterCoordinator``). docs/parameter_server.md.
"""
