"""One front end over many engine worker processes (``--dp-size``): the frames between
them (``wire``), the worker's side (``worker``), routing (``routing``) and the front
end's ``EngineBackend`` (``frontend``)."""
