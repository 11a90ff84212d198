"""astream.ops"""
