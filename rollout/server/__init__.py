"""An OpenAI-compatible HTTP server over an `Engine` or a `RolloutCluster`
(`rollout serve`; docs/serving.md). Importing it needs FastAPI and uvicorn
(`pip install rollout-engine[serve]`); never Ray, which a cluster backend
brings through `rollout.cluster`."""

from .app import create_app
from .backend import Backend, ClusterBackend, EngineBackend
from .config import ServerConfig
from .run import ServerThread, start_server

__all__ = ["Backend", "ClusterBackend", "EngineBackend", "ServerConfig", "ServerThread", "create_app", "start_server"]
