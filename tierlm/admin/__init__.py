"""The admin area: who may call what (access); /metrics (metrics); the dashboard later."""
