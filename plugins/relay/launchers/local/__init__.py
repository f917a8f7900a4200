"""The local launcher: one node agent process per simulated node on this machine.

Besides launching, it keeps agents warm (a resident per DAG run, standbys, spares,
prestarted residents) and lets a segment adopt the workload the previous one left
training: the machinery only a launcher whose processes outlive an attempt can offer.
"""
