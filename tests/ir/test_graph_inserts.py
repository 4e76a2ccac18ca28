"""Graph.batched_inserts: nodes inserted `before=` others inside a batch end where one-by-one
inserts put them (in the order added, a node inserted before a batch-inserted one included), and
Graph.position answers from the order at entry."""

from __future__ import annotations

import numpy as np
import pytest

from aviatorc.ir import Graph, TensorType, add_value


def chain(g: Graph) -> list:
    x = g.add_input("x", TensorType("float32", (2,)))
    nodes = []
    value = x
    for i in range(4):
        value = add_value(g, "Neg", [value], name=f"n{i}")
        nodes.append(value.producer)
    g.outputs = [value]
    return nodes


def insert(g: Graph, nodes: list) -> None:
    c = g.add_constant(np.ones(2, np.float32), "one")
    a = add_value(g, "Relu", [c], name="a", before=nodes[2])
    add_value(g, "Sigmoid", [c], name="b", before=a.producer)  # before a node of this batch
    add_value(g, "Abs", [c], name="d", before=nodes[0])
    add_value(g, "Exp", [c], name="e", before=nodes[2])


def test_a_batch_places_nodes_as_one_by_one_inserts_do():
    one, batched = Graph(), Graph()
    insert(one, chain(one))
    nodes = chain(batched)
    with batched.batched_inserts():
        assert batched.position(nodes[3]) == 3
        insert(batched, nodes)
        assert batched.position(nodes[3]) == 3  # the order at entry
        assert [n.name for n in batched.nodes] == ["n0", "n1", "n2", "n3"]  # placed on exit
    assert [n.name for n in batched.nodes] == [n.name for n in one.nodes] == ["d", "n0", "n1", "b", "a", "e", "n2", "n3"]


def test_removing_an_anchor_inside_a_batch_is_an_error():
    g = Graph()
    x = g.add_input("x", TensorType("float32", (2,)))
    dead = add_value(g, "Neg", [x], name="dead")
    g.outputs = [add_value(g, "Abs", [x], name="out")]
    with pytest.raises(RuntimeError, match="anchor node was removed"):
        with g.batched_inserts():
            add_value(g, "Relu", [x], name="r", before=dead.producer)
            g.remove_node(dead.producer)
