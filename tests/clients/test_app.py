"""The ClientApp module: how the default app travels to a simulation's actors."""

from __future__ import annotations

import pickle

import pytest
import ray.cloudpickle as cloudpickle

from clients.app import app, app_named, app_with


def test_the_default_client_app_travels_to_an_actor_as_a_reference():
    # Flower's simulation engine pickles the app, in a closure, into every message's Ray task.
    def load():
        return app

    sent = cloudpickle.dumps(load)
    assert pickle.loads(sent)() is app
    assert len(sent) < len(cloudpickle.dumps(app_with())) / 3  # not the app's handlers and mods
    with pytest.raises(ValueError, match="names no ClientApp"):
        app_named("clients.app:hello")
