"""A test bed of namespace hosts (and a Slurm cluster on them), for tests and `relay testbed`.

Each host is a network namespace with a veth on a bridge this code creates
(198.18.0.0/24, the benchmarking test range; 198.18.0.1 is the root side), its
own hostname, mount table (a private RELAY_HOME, its own /etc/hosts) and PID
namespace. Root only. Everything made is named in a state file, so teardown
removes exactly that — also when setup fails halfway.
"""

from relay.tools.testbed.hosts import Host, TestBed, TestBedError, can_run_testbed

__all__ = ["Host", "TestBed", "TestBedError", "can_run_testbed"]
