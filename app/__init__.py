"""The application floor: what the drivers share above the engine (arguments and the resolved config, the process
and JAX set-up, logging, run directories, tracking, the launcher, benchmark helpers)."""
