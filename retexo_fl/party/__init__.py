"""The party wing: what runs on a client.

A client holds its partition and never lets a raw feature, label or edge leave it: the
:class:`~retexo_fl.party.client.Client` and its lazy and eager kinds, the message handlers a
ClientApp or the in-process engine calls (:mod:`~retexo_fl.party.handlers`), the state a client
keeps between messages (:mod:`~retexo_fl.party.state`) and its half of secure aggregation
(:mod:`~retexo_fl.party.secure_reply`). Nothing here imports :mod:`retexo_fl.coordinator`: the
two wings exchange messages only (:mod:`retexo_fl.protocol`) and share record types
(:mod:`retexo_fl.records`).
"""
