"""The fleet: autoscaling policy and its loop, `tokenyard serve`, the fleet simulator."""
