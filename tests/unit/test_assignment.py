from engine.swarm.assignment import Assignment, NodeSlot, assign_new_node, rebalance, remove_node


def test_joining_nodes_fill_least_covered_stage_front_to_back():
    a = Assignment(stage_layers=[2, 2])
    stages = [assign_new_node(a, NodeSlot(f"p{i}")) for i in range(5)]
    assert stages == [0, 1, 0, 1, 0]
    assert a.coverage() == [3, 2]
    assert a.complete()


def test_node_that_cannot_hold_a_stage_is_not_assigned_to_it():
    a = Assignment(stage_layers=[4, 1])
    assert assign_new_node(a, NodeSlot("small", max_layers=1)) == 1
    assert assign_new_node(a, NodeSlot("tiny", max_layers=0)) is None
    assert not a.complete()


def test_rebalance_moves_a_replica_into_an_emptied_stage():
    a = Assignment(stage_layers=[2, 2])
    for i in range(4):
        assign_new_node(a, NodeSlot(f"p{i}"))
    for peer in a.replicas()[1]:
        remove_node(a, peer)
    assert a.coverage() == [2, 0]
    moves = rebalance(a)
    assert len(moves) == 1 and moves[0][1:] == (0, 1)
    assert a.coverage() == [1, 1]


def test_rebalance_does_nothing_when_no_stage_has_a_spare_replica():
    a = Assignment(stage_layers=[2, 2, 2])
    for i in range(2):
        assign_new_node(a, NodeSlot(f"p{i}"))
    assert rebalance(a) == []
    assert a.coverage() == [1, 1, 0]
