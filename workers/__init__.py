"""One rank's work: models, KV memory, batches, model runner, scheduler and the in-process
Engine. Implements the protocols `attention/` defines; never imports Ray, gRPC or Serve."""
