"""Trainer-side helpers for RL loops that drive a multiserve fleet (they import jax; the
HTTP side never imports them): `jax_weight_sender.JaxWeightSender`."""
