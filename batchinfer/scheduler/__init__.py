"""The scheduler daemon: intake, staging, packing policy, dispatch, leases and job accounting."""
