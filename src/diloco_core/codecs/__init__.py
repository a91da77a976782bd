"""The codecs: how pseudo-gradients travel on the wire (``base.Codec``); the names config gives them (``names``)."""
